"""Persistent state of the batch API: files, batches, per-request results, contexts (SQLite, WAL).

Life cycle: every state change is one transaction (synchronous=FULL), so a
core killed at any instant restarts with a consistent picture: a request is
either pending or done-with-its-result, never half. File contents live under
`data_dir/files/`, written to a temporary name, fsynced, then renamed; a file
row exists only once its content is complete.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL, errors TEXT,
    output_file_id TEXT, error_file_id TEXT, created_at INTEGER NOT NULL, expires_at INTEGER,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS batch_requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, body TEXT, state TEXT NOT NULL,
    result TEXT, PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS batch_requests_state ON batch_requests (batch_id, state);
CREATE TABLE IF NOT EXISTS contexts (
    id TEXT PRIMARY KEY, token_ids TEXT NOT NULL, created_at INTEGER NOT NULL);
"""

TIMESTAMPS = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class BatchStore:
    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.dir / "batches.sqlite3", isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        for tmp in self.files_dir.glob("*.part"):   # uploads cut short by a crash
            tmp.unlink()

    def tx(self) -> _Tx:
        return _Tx(self.db)

    # ---- files ----------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, file_id: str, filename: str, purpose: str, size: int) -> dict:
        with self.tx():
            self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)",
                            (file_id, filename, purpose, size, int(time.time())))
        obj = self.get_file(file_id)
        assert obj is not None            # its row was just written
        return obj

    def write_file(self, filename: str, purpose: str, data: bytes, file_id: str | None = None) -> dict:
        """Store `data` atomically (temporary name, fsync, rename, then the row); an existing id is replaced."""
        file_id = file_id or new_id("file")
        tmp = self.files_dir / f"{file_id}.part"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(self.file_path(file_id))
        return self.add_file(file_id, filename, purpose, len(data))

    def get_file(self, file_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return file_object(row) if row else None

    def list_files(self, purpose: str | None = None, after: str | None = None, limit: int = 10000,
                   ascending: bool = False) -> tuple[list[dict], bool]:
        """A page of files, newest first (or oldest) in upload order (created_at, then the row's insertion
        order within a second); `after`: the id of the previous page's last file (an unknown id starts from
        the first)."""
        anchor = self.db.execute("SELECT created_at, rowid FROM files WHERE id = ?", (after,)).fetchone() \
            if after else None
        direction, cmp = ("ASC", ">") if ascending else ("DESC", "<")
        where, args = "(? IS NULL OR purpose = ?)", [purpose, purpose]
        if anchor is not None:
            where += f" AND (created_at, rowid) {cmp} (?, ?)"
            args += [anchor["created_at"], anchor["rowid"]]
        rows = self.db.execute(f"SELECT * FROM files WHERE {where} ORDER BY created_at {direction}, "
                               f"rowid {direction} LIMIT ?", (*args, limit + 1)).fetchall()
        return [file_object(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self.tx():
            gone = self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        self.file_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # ---- batches --------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, window: str, metadata: dict | None) -> dict:
        batch_id = new_id("batch")
        now = int(time.time())
        with self.tx():
            seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            self.db.execute("INSERT INTO batches (id, seq, input_file_id, endpoint, completion_window, metadata, "
                            "status, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, 'validating', ?, ?)",
                            (batch_id, seq, input_file_id, endpoint, window, json.dumps(metadata) if metadata
                             is not None else None, now, now + 24 * 3600))
        batch = self.get_batch(batch_id)
        assert batch is not None          # its row was just written
        return batch

    def batch_row(self, batch_id: str) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()

    def get_batch(self, batch_id: str) -> dict | None:
        row = self.batch_row(batch_id)
        return self.batch_object(row) if row else None

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        if after:
            anchor = self.batch_row(after)
            seq = anchor["seq"] if anchor else 1 << 62
        else:
            seq = 1 << 62
        rows = self.db.execute("SELECT * FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                               (seq, limit + 1)).fetchall()
        return [self.batch_object(r) for r in rows[:limit]], len(rows) > limit

    def set_status(self, batch_id: str, status: str, **fields: int | str) -> None:
        fields[f"{status}_at"] = int(time.time())
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.tx():
            self.db.execute(f"UPDATE batches SET status = ?, {cols} WHERE id = ?",
                            (status, *fields.values(), batch_id))

    def unfinished_batches(self) -> list[str]:
        rows = self.db.execute("SELECT id FROM batches WHERE status IN "
                               "('validating', 'in_progress', 'finalizing', 'cancelling') ORDER BY seq").fetchall()
        return [r["id"] for r in rows]

    def counts(self, batch_id: str) -> dict:
        row = self.db.execute("SELECT COUNT(*) AS total, SUM(state = 'done') AS done, SUM(state = 'error') AS err "
                              "FROM batch_requests WHERE batch_id = ?", (batch_id,)).fetchone()
        return {"total": row["total"] or 0, "completed": row["done"] or 0, "failed": row["err"] or 0}

    def batch_object(self, row: sqlite3.Row) -> dict:
        obj = {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
               "errors": json.loads(row["errors"]) if row["errors"] else None,
               "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
               "status": row["status"], "output_file_id": row["output_file_id"],
               "error_file_id": row["error_file_id"],
               "request_counts": self.counts(row["id"]),
               "metadata": json.loads(row["metadata"]) if row["metadata"] else None}
        for ts in TIMESTAMPS:
            obj[ts] = row[ts]
        return obj

    # ---- requests -------------------------------------------------------------
    def add_requests(self, batch_id: str, rows: list[tuple[int, str | None, str | None, str, str | None]]) -> None:
        """rows: (line, custom_id, body JSON, state 'pending'|'error', result JSON for errors)."""
        with self.tx():
            self.db.executemany("INSERT OR IGNORE INTO batch_requests VALUES (?, ?, ?, ?, ?, ?)",
                                [(batch_id, *r) for r in rows])
            self.db.execute("UPDATE batches SET total = ? WHERE id = ?", (len(rows), batch_id))

    def pending(self, batch_id: str) -> list[sqlite3.Row]:
        return self.db.execute("SELECT line, custom_id, body FROM batch_requests WHERE batch_id = ? AND "
                               "state = 'pending' ORDER BY line", (batch_id,)).fetchall()

    def finish_requests(self, batch_id: str, results: list[tuple[int, str, dict]]) -> None:
        """Record finished requests (line, state, result line) in one transaction."""
        with self.tx():
            self.db.executemany("UPDATE batch_requests SET state = ?, result = ? WHERE batch_id = ? AND line = ? "
                                "AND state = 'pending'",
                                [(state, json.dumps(result), batch_id, line) for line, state, result in results])

    def results(self, batch_id: str, state: str) -> list[str]:
        rows = self.db.execute("SELECT result FROM batch_requests WHERE batch_id = ? AND state = ? ORDER BY line",
                               (batch_id, state)).fetchall()
        return [r["result"] for r in rows]

    # ---- contexts -------------------------------------------------------------
    def save_context(self, ctx_id: str, token_ids: list[int]) -> None:
        with self.tx():
            self.db.execute("INSERT OR IGNORE INTO contexts VALUES (?, ?, ?)",
                            (ctx_id, json.dumps(token_ids), int(time.time())))

    def delete_context(self, ctx_id: str) -> None:
        with self.tx():
            self.db.execute("DELETE FROM contexts WHERE id = ?", (ctx_id,))

    def contexts(self) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM contexts ORDER BY created_at").fetchall()

    def close(self) -> None:
        self.db.close()


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}
