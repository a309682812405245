"""Persistent state of the batch API: files, batches, per-request results, contexts (SQLite, WAL).

Life cycle: every state change is one transaction (synchronous=FULL), so a
core killed at any instant restarts with a consistent picture: a request is
either pending or done-with-its-result, never half. File contents live under
`data_dir/files/`, written to a temporary name, fsynced, then renamed; a file
row exists only once its content is complete.

A full disk: a write the volume has no room for (SQLite's "database or disk
is full", or ENOSPC/EDQUOT from a file write) rolls its transaction back,
checkpoints and truncates the WAL (`PRAGMA wal_checkpoint(TRUNCATE)`: a WAL
left at its high-water mark keeps the volume full), calls `on_full` (the
runner counts it) and raises `DiskFull`, whose message names ENOSPC, the free
space and about how much the write needs. Nothing committed is lost; the
caller decides (the runner pauses the batch, the API answers 507). `notices`
holds, in memory, a batch's transient error (a pause for space): shown in its
`errors` without a write to the full disk. Between failures the WAL is
truncated to at most 1 MiB after each checkpoint (`journal_size_limit`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("edgecore.batch")

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


# Room a write needs beyond its own bytes (pages rewritten around rows, the WAL frames and their checkpoint).
SLACK = 128 << 10


class DiskFull(Exception):
    """A write refused for lack of space on the data volume (ENOSPC); nothing of it was committed."""

    def __init__(self, what: str, where: Path, free: int, needed: int) -> None:
        super().__init__(f"no space left on device (ENOSPC) {what} in {where}: {_size(free)} free, about "
                         f"{_size(needed)} needed")
        self.free, self.needed = free, needed


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` says the volume is full: ENOSPC/EDQUOT, or SQLite's SQLITE_FULL ("database or disk is
    full")."""
    if isinstance(exc, DiskFull):
        return True
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return (code is not None and code & 0xFF == sqlite3.SQLITE_FULL) or "disk is full" in str(exc)
    return False


def _size(n: int) -> str:
    return f"{n} B" if n < 1 << 10 else f"{n / 1024:.0f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


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
        self.db.execute("PRAGMA journal_size_limit=1048576")     # the WAL shrinks back after each checkpoint
        self.db.executescript(SCHEMA)
        self.on_full: Callable[[DiskFull], None] | None = None     # set by the runner: counts refused writes
        self.notices: dict[str, dict] = {}     # batch id → an error shown in its `errors` (not stored)
        for tmp in self.files_dir.glob("*.part"):   # uploads cut short by a crash
            tmp.unlink()

    def tx(self, what: str = "updating the batch database", payload: int = 0) -> _Tx:
        """One transaction; a full disk rolls it back and raises `DiskFull` (`payload`: the bytes it writes)."""
        return _Tx(self, what, payload)

    # ---- a full volume ----------------------------------------------------------------
    def free_bytes(self) -> int:
        return shutil.disk_usage(self.dir).free

    def checkpoint(self) -> None:
        """Copy the WAL into the database and truncate it to zero bytes (best effort: the copy itself may need
        room the volume lacks)."""
        try:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:
            log.debug("WAL checkpoint failed: %s", exc)

    def full(self, exc: BaseException, what: str, payload: int = 0) -> DiskFull:
        """The `DiskFull` for a write refused with `exc`, after the WAL is checkpointed; counted by `on_full`."""
        self.checkpoint()
        err = DiskFull(what, self.dir, self.free_bytes(), 2 * payload + SLACK)
        if self.on_full is not None:
            self.on_full(err)
        return err

    # ---- files ----------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, file_id: str, filename: str, purpose: str, size: int) -> dict:
        with self.tx("recording a file"):
            self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)",
                            (file_id, filename, purpose, size, int(time.time())))
        obj = self.get_file(file_id)
        assert obj is not None            # its row was just written
        return obj

    def write_file(self, filename: str, purpose: str, data: bytes, file_id: str | None = None) -> dict:
        """Store `data` atomically (temporary name, fsync, rename, then the row); an existing id is replaced."""
        file_id = file_id or new_id("file")
        tmp = self.files_dir / f"{file_id}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if is_disk_full(exc):
                raise self.full(exc, f"writing {filename}", len(data)) from None
            raise
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
        """Delete the row, then the content; on a full disk the content goes first (deleting frees space,
        and the row's deletion needs some)."""
        try:
            with self.tx("deleting a file"):
                gone = self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        except DiskFull:
            self.file_path(file_id).unlink(missing_ok=True)
            with self.tx("deleting a file"):
                gone = self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        self.file_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # ---- batches --------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, window: str, metadata: dict | None) -> dict:
        batch_id = new_id("batch")
        now = int(time.time())
        with self.tx("creating a batch"):
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
        with self.tx(f"setting a batch {status}"):
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
               "errors": self.notices.get(row["id"]) or (json.loads(row["errors"]) if row["errors"] else None),
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
        with self.tx("storing a batch's requests", sum(len(r[2] or "") + len(r[4] or "") for r in rows)):
            self.db.executemany("INSERT OR IGNORE INTO batch_requests VALUES (?, ?, ?, ?, ?, ?)",
                                [(batch_id, *r) for r in rows])
            self.db.execute("UPDATE batches SET total = ? WHERE id = ?", (len(rows), batch_id))

    def pending(self, batch_id: str) -> list[sqlite3.Row]:
        return self.db.execute("SELECT line, custom_id, body FROM batch_requests WHERE batch_id = ? AND "
                               "state = 'pending' ORDER BY line", (batch_id,)).fetchall()

    def finish_requests(self, batch_id: str, results: list[tuple[int, str, dict]]) -> None:
        """Record finished requests (line, state, result line) in one transaction."""
        rows = [(state, json.dumps(result), batch_id, line) for line, state, result in results]
        with self.tx(f"saving {len(rows)} batch results", sum(len(r[1]) for r in rows)):
            self.db.executemany("UPDATE batch_requests SET state = ?, result = ? WHERE batch_id = ? AND line = ? "
                                "AND state = 'pending'", rows)

    def results(self, batch_id: str, state: str) -> list[str]:
        rows = self.db.execute("SELECT result FROM batch_requests WHERE batch_id = ? AND state = ? ORDER BY line",
                               (batch_id, state)).fetchall()
        return [r["result"] for r in rows]

    # ---- contexts -------------------------------------------------------------
    def save_context(self, ctx_id: str, token_ids: list[int]) -> None:
        with self.tx("saving a context"):
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
    def __init__(self, store: BatchStore, what: str, payload: int) -> None:
        self.store, self.db, self.what, self.payload = store, store.db, what, payload

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _: object) -> None:
        if exc is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.Error as failed:
                exc = failed
                if not is_disk_full(failed):
                    self._rollback()
                    raise
        self._rollback()
        if is_disk_full(exc):
            raise self.store.full(exc, self.what, self.payload) from exc

    def _rollback(self) -> None:
        if self.db.in_transaction:      # SQLite may have rolled a full disk's transaction back itself
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error as exc:
                log.warning("rollback failed: %s", exc)


def file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}
