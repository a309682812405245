"""A full data volume loses no finished batch result: the batch pauses (status kept, `errors` naming ENOSPC and
the room needed), the store truncates its WAL, and the batch resumes by itself once there is room; uploads and
batch creation answer 507 "no space left"; refused writes and failed request tasks are counted.

Two ways: an injected SQLITE_FULL / ENOSPC (deterministic), and a real tmpfs filled to the brim (skipped where
mounting is not permitted). The engine is a stand-in (the runner and store are what is tested), so the module
takes a few seconds.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import sqlite3
import subprocess
import time
from collections import Counter
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from edgecore.core.batch_api import BatchAPI
from edgecore.core.batch_runner import BatchRunner
from edgecore.core.batch_store import BatchStore
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.openai.http import error_middleware

pytestmark = pytest.mark.timeout(60)
MODEL = "pydoc-llama"
FAIL_TOKEN = 7          # a prompt holding it makes the stand-in engine raise (a bug, not a request error)


class FakeEngine:
    """The handle's surface the batch runner uses; every line generates `text` (after `gate`, when set)."""

    def __init__(self, tokenizer, text: str = "ok"):
        self.tokenizer, self.text = tokenizer, text
        self.config = SimpleNamespace(vocab_size=1000)
        self.max_model_len = 512
        self.gate: asyncio.Event | None = None
        self.calls: Counter[str] = Counter()       # line → generations (a finished line never runs twice)

    async def generate(self, *args, **kwargs):
        # (id, prompt, params, ...) or one request object: either engine API
        request_id, prompt = (args[0], args[1]) if isinstance(args[0], str) else (args[0].request_id,
                                                                                  args[0].prompt)
        line = str(request_id).split("/")[1]
        self.calls[line] += 1
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if FAIL_TOKEN in prompt:
            raise RuntimeError("engine bug")
        yield RequestOutput(str(request_id), [5, 6], self.text, True, "length", None, len(prompt), 0, 2)


class FlakyDb:
    """The store's connection, whose COMMITs fail as SQLite's do on a full disk while `full` (from the
    `fill_after`+1-th result write on)."""

    def __init__(self, db: sqlite3.Connection, fill_after: int | None = None):
        self._db, self.fill_after, self.full, self.writes, self.statements = db, fill_after, False, 0, []

    def execute(self, sql, *args):
        self.statements.append(sql)
        if self.full and sql.startswith("COMMIT"):
            raise sqlite3.OperationalError("database or disk is full")
        return self._db.execute(sql, *args)

    def executemany(self, sql, rows):
        if sql.startswith("UPDATE batch_requests"):
            self.writes += 1
            if self.fill_after is not None and self.writes > self.fill_after:
                self.full = True
        return self._db.executemany(sql, rows)

    def __getattr__(self, name):
        return getattr(self._db, name)


def lines(n: int, fail=()) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": MODEL, "prompt": [1, FAIL_TOKEN if i in fail else 2, 3],
                                        "max_tokens": 2}}) + "\n" for i in range(n)).encode()


async def start(aiohttp_client, store: BatchStore, engine: FakeEngine, inflight: int = 8):
    runner = BatchRunner(engine, store, MODEL, max_inflight=inflight)
    runner.space_poll, runner.retry_every = 0.02, 60.0
    app = web.Application(middlewares=[error_middleware([], 1 << 20)])
    BatchAPI(engine, store, runner, None, 1 << 22).routes(app)
    runner.start()
    return runner, await aiohttp_client(app)


async def upload(client, data: bytes) -> tuple[int, dict]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="in.jsonl", content_type="application/jsonl")
    r = await client.post("/v1/files", data=form)
    return r.status, await r.json()


async def create(client, file_id: str) -> tuple[int, dict]:
    r = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                               "completion_window": "24h"})
    return r.status, await r.json()


async def until(client, batch_id: str, check, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = await (await client.get(f"/v1/batches/{batch_id}")).json()
        if check(batch):
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch {batch_id} never got there: {batch}")


def failures(runner: BatchRunner, cause: str) -> float:
    return runner.metrics.registry.get_sample_value("edgecore:core_batch_failures_total",
                                                    {"cause": cause, "model_name": MODEL}) or 0.0


async def output(client, batch: dict) -> list[dict]:
    r = await client.get(f"/v1/files/{batch['output_file_id']}/content")
    return [json.loads(x) for x in (await r.text()).splitlines()]


async def test_injected_full_disk_pauses_and_resumes_without_losing_a_result(aiohttp_client, tokenizer, tmp_path,
                                                                             monkeypatch):
    store = BatchStore(tmp_path)
    engine = FakeEngine(tokenizer)
    runner, client = await start(aiohttp_client, store, engine)
    try:
        status, f = await upload(client, lines(200))
        assert status == 200
        flaky = store.db = FlakyDb(store.db, fill_after=2)            # two result commits, then full
        monkeypatch.setattr(store, "free_bytes", lambda: 1000 if flaky.full else 1 << 30)
        status, batch = await create(client, f["id"])
        assert status == 200
        paused = await until(client, batch["id"], lambda b: b["errors"] is not None)
        assert paused["status"] == "in_progress", paused
        error = paused["errors"]["data"][0]
        assert error["code"] == "insufficient_storage"
        assert "ENOSPC" in error["message"] and "needed" in error["message"] and "resumes" in error["message"]
        assert paused["request_counts"]["completed"] < 200            # the rest is held in memory
        assert "PRAGMA wal_checkpoint(TRUNCATE)" in flaky.statements  # the WAL given back after the refusal
        assert failures(runner, "disk_full") >= 1
        # while full: an upload (its row refused) and a batch are 507s, not 500s with a traceback
        status, body = await upload(client, lines(3))
        assert status == 507 and "no space left" in body["error"]["message"], body
        assert body["error"]["code"] == "insufficient_storage"
        assert not [p for p in store.files_dir.iterdir() if p.name != f["id"]]    # no orphan content
        status, body = await create(client, f["id"])
        assert status == 507 and "no space left" in body["error"]["message"], body
        with monkeypatch.context() as m:                              # the content write itself: ENOSPC
            m.setattr("edgecore.core.batch_api.os.fsync", lambda _: (_ for _ in ()).throw(
                OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
            status, body = await upload(client, lines(3))
        assert status == 507 and "no space left" in body["error"]["message"], body
        assert failures(runner, "disk_full") >= 4
        flaky.full, flaky.fill_after = False, None                    # room again
        done = await until(client, batch["id"], lambda b: b["status"] == "completed")
        assert done["errors"] is None and done["request_counts"] == {"total": 200, "completed": 200, "failed": 0}
        out = await output(client, done)
        assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(200))
        assert set(engine.calls.values()) == {1}                      # no finished line computed twice
    finally:
        await runner.stop()
        store.close()


async def test_failed_request_tasks_are_error_lines_counted_and_logged_once(aiohttp_client, tokenizer, tmp_path,
                                                                            caplog):
    store = BatchStore(tmp_path)
    runner, client = await start(aiohttp_client, store, FakeEngine(tokenizer))
    unretrieved = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx.get("message")))
    try:
        _, f = await upload(client, lines(20, fail=range(0, 20, 2)))
        _, batch = await create(client, f["id"])
        with caplog.at_level(logging.ERROR, logger="edgecore.batch"):
            done = await until(client, batch["id"], lambda b: b["status"] == "completed")
        assert done["request_counts"] == {"total": 20, "completed": 10, "failed": 10}
        errors = [json.loads(x) for x in (await (await client.get(
            f"/v1/files/{done['error_file_id']}/content")).text()).splitlines()]
        assert {e["error"]["code"] for e in errors} == {"internal_error"} and len(errors) == 10
        assert failures(runner, "task") == 10
        logged = [r for r in caplog.records if "failed inside the core" in r.getMessage()]
        assert len(logged) == 2, [r.getMessage() for r in logged]    # the first (traceback), then how many
        gc.collect()
        assert not [m for m in unretrieved if "never retrieved" in str(m)]
    finally:
        await runner.stop()
        store.close()


@pytest.fixture
def small_volume(tmp_path):
    """A 4 MiB tmpfs (root and CAP_SYS_ADMIN needed; skipped otherwise)."""
    vol = tmp_path / "vol"
    vol.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(vol)], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs to fill: {exc}")
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.strip() or r.returncode}")
    yield vol
    subprocess.run(["umount", "-l", str(vol)], check=False, timeout=10)


def fill(path, leave: int) -> None:
    """Write `path` until the volume is full, then give back `leave` bytes."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        f.truncate(max(0, f.tell() - leave))


async def test_real_full_tmpfs_pauses_then_finishes_every_line(aiohttp_client, tokenizer, small_volume):
    store = BatchStore(small_volume)
    engine = FakeEngine(tokenizer, text="x" * 1500)                 # ~1.8 KB a result line
    engine.gate = asyncio.Event()
    runner, client = await start(aiohttp_client, store, engine, inflight=16)
    filler = small_volume / "filler"
    try:
        _, f = await upload(client, lines(400))
        _, batch = await create(client, f["id"])
        await until(client, batch["id"], lambda b: b["status"] == "in_progress")
        fill(filler, leave=160 << 10)
        engine.gate.set()
        paused = await until(client, batch["id"], lambda b: b["errors"] is not None)
        assert paused["status"] == "in_progress", paused
        assert "ENOSPC" in paused["errors"]["data"][0]["message"]
        assert paused["request_counts"]["completed"] < 400
        assert failures(runner, "disk_full") >= 1
        status, body = await upload(client, lines(50))
        assert status == 507 and "no space left" in body["error"]["message"], body
        filler.unlink()                                               # space returns
        done = await until(client, batch["id"], lambda b: b["status"] == "completed")
        assert done["errors"] is None and done["request_counts"]["completed"] == 400
        out = await output(client, done)
        assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(400))
        assert all(o["response"]["body"]["choices"][0]["text"] == engine.text for o in out)
    finally:
        await runner.stop()
        store.close()
