"""Runs batches on the core's engine: validate → in_progress → finalizing → completed/cancelled/failed/expired.

Life cycle of a batch: `validating` reads the input file line by line on a
worker thread (JSON object, unique `custom_id`, `method` POST, `url` = the
batch endpoint, body valid for it); invalid lines become error-file entries
with their line numbers, the rest are stored as pending; a file with no JSON
line at all fails the batch (`errors.data`); a batch cancelled meanwhile
starts no request. `in_progress` runs pending requests at batch
priority (interactive prefill from edges is always admitted first) with at
most `max_inflight` in the engine; each finished request's response line is
committed with its state (grouped, one transaction per `COMMIT_EVERY` results
or `COMMIT_DELAY` seconds), so after a crash only uncommitted requests run
again and every custom_id appears exactly once. `cancelling`
(or expiry) aborts what is in flight and keeps finished results;
`finalizing` writes the output and error files under deterministic ids, so
finalizing twice after a crash rewrites the same files.

A full data volume never loses a finished result, and never fails the batch:
the batch pauses. A store write refused for lack of space (`DiskFull`:
SQLite's "database or disk is full" or ENOSPC) keeps the results it held in
memory, starts no further request (those in flight finish and are kept too),
and leaves the batch in the status it had (`validating`, `in_progress`,
`finalizing` or `cancelling`) with `errors.data[0]` = {"code": "insufficient_storage",
"message": "paused: no space left on device (ENOSPC) ... N free, about M
needed; ..."} (held in memory: writing it would need the space that is
missing). The store truncates its WAL after each refusal. Every
`space_poll` seconds the runner checks the free space; once it reaches what
the write needed (or every `retry_every` seconds regardless) it saves the
kept results and resumes the batch from its stored state, exactly as after a
crash. Each refused write counts in `edgecore:core_batch_failures_total{cause="disk_full"}`
and the pause is logged once (and its end once). A request task that fails
with anything but a request error (a bug) becomes an `internal_error` line of
the error file, counts in `{cause="task"}`, and is logged once per batch
with the number of such lines. A core stopped while paused loses only the
results kept in memory: their requests run again when it restarts.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

from edgecore.core.batch_store import BatchStore, DiskFull
from edgecore.core.metrics import CoreMetrics
from edgecore.shared.engine.handle import EngineHandle
from edgecore.shared.errors import RequestError
from edgecore.shared.openai.request import ApiError, ParsedRequest, check_model, parse_chat, parse_completion
from edgecore.shared.openai.response import ChoiceResult, TokenText, response_body
from edgecore.shared.text.tokenizer import Tokenizer

log = logging.getLogger("edgecore.batch")
ParseFn = Callable[[dict, Tokenizer, int, int], ParsedRequest]
ENDPOINTS: dict[str, tuple[ParseFn, bool]] = {"/v1/chat/completions": (parse_chat, True),
                                              "/v1/completions": (parse_completion, False)}
BATCH_PRIORITY = 1
COMMIT_EVERY = 32
COMMIT_DELAY = 0.05
SPACE_POLL = 1.0          # seconds between free-space checks while paused on a full disk
RETRY_EVERY = 30.0        # ... and between retries while the space still looks too small


class BatchRunner:
    def __init__(self, handle: EngineHandle, store: BatchStore, model_name: str, max_inflight: int = 64,
                 metrics: CoreMetrics | None = None, parallel: bool = False) -> None:
        self.handle = handle
        self.parallel = parallel        # a parallel core computes no prompt logprobs
        self.metrics = metrics or CoreMetrics(model_name)
        self.store = store
        self.model_name = model_name
        self.max_inflight = max_inflight
        self.texts = TokenText(_tokenizer(handle))
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._cancelled: set[str] = set()
        self._unsaved: list[tuple[int, str, dict]] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._batch_id: str | None = None
        self._full: DiskFull | None = None          # the refused write a pause waits out
        self._paused_id: str | None = None          # the batch paused on it
        self._task_errors = 0                      # request tasks of the running batch that raised
        self.space_poll, self.retry_every = SPACE_POLL, RETRY_EVERY
        store.on_full = lambda _: self.metrics.batch_failures.labels("disk_full").inc()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def notify(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        self._cancelled.add(batch_id)
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            for batch_id in self.store.unfinished_batches():
                if not await self._attempt(batch_id):
                    break                       # a full disk: nothing else runs until it has room
            if self._full is not None:
                await self._wait_for_space()
                continue
            await self._wake.wait()
            self._wake.clear()

    async def _attempt(self, batch_id: str) -> bool:
        """Run the batch from its stored state; False when a full disk paused it."""
        try:
            try:
                await self._process(batch_id)
            except (asyncio.CancelledError, DiskFull):
                raise
            except Exception:   # never lose the runner to one batch; the batch fails visibly
                log.exception("batch %s failed", batch_id)
                self._fail(batch_id, "internal_error", "the batch failed inside the core", None)
        except DiskFull as exc:
            self._pause(batch_id, exc)
            return False
        self._resumed()
        return True

    def _pause(self, batch_id: str, exc: DiskFull) -> None:
        if self._paused_id != batch_id:   # once per pause, not per refused write
            log.warning("batch %s paused: %s; it resumes by itself once there is room", batch_id, exc)
        self._paused_id, self._full = batch_id, exc
        self.store.notices[batch_id] = {"object": "list", "data": [{
            "code": "insufficient_storage", "param": None, "line": None,
            "message": f"paused: {exc}; the batch resumes by itself once there is room"}]}

    def _resumed(self) -> None:
        if self._paused_id is not None:
            log.info("batch %s resumed: %d bytes free on the data volume", self._paused_id, self.store.free_bytes())
            self._paused_id = None

    async def _wait_for_space(self) -> None:
        """Wait until the volume has the room the refused write needed (or `retry_every` passed), then save
        the results kept in memory; the loop then resumes the batch from its stored state."""
        full, waited = self._full, 0.0
        while full is not None:
            await asyncio.sleep(self.space_poll)
            waited += self.space_poll
            if self.store.free_bytes() < full.needed and waited < self.retry_every:
                continue
            waited = 0.0
            self.store.checkpoint()
            self._full = None
            self._flush()
            full = self._full
            if full is not None and self._paused_id is not None:
                self._pause(self._paused_id, full)       # still full: the message says how much now
        self.store.notices.clear()

    def _row(self, batch_id: str) -> sqlite3.Row:
        row = self.store.batch_row(batch_id)
        assert row is not None            # batches are never deleted
        return row

    async def _process(self, batch_id: str) -> None:
        row = self._row(batch_id)
        if row["status"] == "validating":
            if not await self._validate(row):
                return
            # cancelled while it was validated: no request starts
            cancelled = batch_id in self._cancelled or self._row(batch_id)["cancelling_at"]
            self.store.set_status(batch_id, "cancelling" if cancelled else "in_progress")
            row = self._row(batch_id)
        if row["status"] == "in_progress":
            outcome = await self._run(row)
            if self._full is not None:    # results a full disk refused, kept in memory: paused
                raise self._full
            if outcome == "cancelling":
                self.store.set_status(batch_id, "cancelling")
            self.store.set_status(batch_id, "finalizing", **({"expired_at": int(time.time())}
                                                               if outcome == "expired" else {}))
            row = self._row(batch_id)
        final = "cancelled" if row["cancelling_at"] else ("expired" if row["expired_at"] else "completed")
        if row["status"] in ("finalizing", "cancelling"):
            self._finalize(batch_id, final)
        self._cancelled.discard(batch_id)

    # ---- validation -------------------------------------------------------------
    async def _validate(self, row: sqlite3.Row) -> bool:
        """Check the input file's lines on a worker thread (parsing tokenizes every prompt: seconds for a large
        file, during which the event loop keeps serving edges); store them here, on the loop."""
        batch_id = row["id"]
        try:
            rows, json_lines = await asyncio.to_thread(self._check_lines, self.store.file_path(row["input_file_id"]),
                                                       row["endpoint"])
        except OSError:
            self._fail(batch_id, "file_not_found", f"input file {row['input_file_id']} is gone", None)
            return False
        if json_lines == 0:
            self._fail(batch_id, "invalid_file", "the input file is not JSONL: no line holds a JSON object", 1)
            return False
        self.store.add_requests(batch_id, rows)
        return True

    def _check_lines(self, path: Path, endpoint: str
                     ) -> tuple[list[tuple[int, str | None, str | None, str, str | None]], int]:
        """Worker thread: the store's rows for the file's lines (pending, or error with its message), and how
        many lines held JSON."""
        parse, _ = ENDPOINTS[endpoint]
        engine = self.handle
        rows: list[tuple[int, str | None, str | None, str, str | None]] = []
        seen: set[str] = set()
        json_lines = 0
        for number, raw in enumerate(_lines(path), start=1):
            if not raw.strip():
                continue
            custom_id = None
            try:
                obj = json.loads(raw)
                json_lines += 1
                if not isinstance(obj, dict):
                    raise ValueError("each line must be a JSON object")
                custom_id = obj.get("custom_id")
                if not isinstance(custom_id, str) or not custom_id:
                    raise ValueError("'custom_id' must be a non-empty string")
                if custom_id in seen:
                    raise ValueError(f"duplicate custom_id '{custom_id}'")
                if obj.get("method") != "POST":
                    raise ValueError("'method' must be POST")
                if obj.get("url") != endpoint:
                    raise ValueError(f"'url' must be the batch endpoint {endpoint}, got {obj.get('url')!r}")
                body = obj.get("body")
                if not isinstance(body, dict):
                    raise ValueError("'body' must be an object")
                check_model(body, self.model_name)
                parsed = parse(body, _tokenizer(engine), engine.config.vocab_size, engine.max_model_len)
                if parsed.prompt_logprobs is not None and self.parallel:
                    raise ValueError("prompt logprobs (echo with logprobs, prompt_logprobs) need a single-rank core")
            except (ValueError, ApiError) as exc:   # json.JSONDecodeError is a ValueError
                message = f"line {number}: {exc}"
                if isinstance(custom_id, str) and custom_id not in seen:
                    seen.add(custom_id)
                rows.append((number, custom_id if isinstance(custom_id, str) else None, None, "error", json.dumps({
                    "id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id if isinstance(custom_id, str)
                    else None, "response": None,
                    "error": {"code": "invalid_request", "message": message, "line": number}})))
                continue
            seen.add(custom_id)
            rows.append((number, custom_id, json.dumps(body), "pending", None))
        return rows, json_lines

    def _fail(self, batch_id: str, code: str, message: str, line: int | None) -> None:
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": line}]}
        self.store.set_status(batch_id, "failed", errors=json.dumps(errors))

    # ---- execution --------------------------------------------------------------
    def _record(self, line: int, state: str, result: dict) -> None:
        self._unsaved.append((line, state, result))
        if self._full is not None:        # paused on a full disk: kept until it has room
            return
        if len(self._unsaved) >= COMMIT_EVERY:
            self._flush()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(COMMIT_DELAY, self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._unsaved and self._full is None:
            assert self._batch_id is not None     # results are recorded only while `_run` runs a batch
            try:
                self.store.finish_requests(self._batch_id, self._unsaved)
            except DiskFull as exc:       # kept; the batch pauses (`_run_pending` starts nothing more)
                self._full = exc
                return
            self._unsaved = []
            self._resumed()

    async def _run(self, row: sqlite3.Row) -> str:
        batch_id, endpoint = row["id"], row["endpoint"]
        self._batch_id = batch_id
        try:
            return await self._run_pending(row, batch_id, endpoint)
        finally:
            self._flush()

    async def _run_pending(self, row: sqlite3.Row, batch_id: str, endpoint: str) -> str:
        parse, chat = ENDPOINTS[endpoint]
        kept = {line for line, _, _ in self._unsaved}        # finished, waiting for room on the disk
        pending = [r for r in self.store.pending(batch_id) if r["line"] not in kept]
        slots = asyncio.Semaphore(self.max_inflight)
        tasks: set[asyncio.Task] = set()
        outcome = "done"
        self._task_errors = 0

        def done(t: asyncio.Task, req: sqlite3.Row) -> None:
            tasks.discard(t)
            slots.release()
            if not t.cancelled() and (exc := t.exception()) is not None:
                self._task_failed(batch_id, req, exc)

        self.metrics.batch_queued.set(len(pending))
        for req in pending:
            await slots.acquire()
            if self._full is not None:    # a full disk: start nothing more; those in flight finish, kept
                outcome = "paused"
                break
            if batch_id in self._cancelled or self._row(batch_id)["cancelling_at"]:
                outcome = "cancelling"
                break
            if time.time() > row["expires_at"]:
                outcome = "expired"
                break
            self.metrics.batch_queued.dec()
            task = asyncio.create_task(self._one(batch_id, req, parse, chat))
            tasks.add(task)
            task.add_done_callback(functools.partial(done, req=req))
        while tasks:
            if outcome == "done" and batch_id in self._cancelled:
                outcome = "cancelling"
            if outcome not in ("done", "paused"):
                for task in list(tasks):
                    task.cancel()
            await asyncio.wait(set(tasks), timeout=0.2)
        self.metrics.batch_queued.set(0)
        if self._task_errors > 1:
            log.error("batch %s: %d requests failed inside the core (internal_error lines)", batch_id,
                      self._task_errors)
        return outcome

    def _task_failed(self, batch_id: str, req: sqlite3.Row, exc: BaseException) -> None:
        """A request task raised (not a request error: a bug): an `internal_error` line, counted; the first of
        a batch is logged with its traceback, the rest only counted (`_run_pending` logs their number)."""
        self._task_errors += 1
        self.metrics.batch_failures.labels("task").inc()
        if self._task_errors == 1:
            log.error("batch %s: line %d failed inside the core", batch_id, req["line"], exc_info=exc)
        self._record(req["line"], "error", {
            "id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": req["custom_id"], "response": None,
            "error": {"code": "internal_error", "line": req["line"],
                      "message": f"line {req['line']}: the core failed on this request ({type(exc).__name__})"}})

    async def _one(self, batch_id: str, req: sqlite3.Row, parse: ParseFn, chat: bool) -> None:
        engine = self.handle
        body = json.loads(req["body"])
        parsed = parse(body, _tokenizer(engine), engine.config.vocab_size, engine.max_model_len)
        rid = f"req_{uuid.uuid4().hex[:24]}"
        results = [ChoiceResult() for _ in parsed.params]

        async def choice(i: int) -> None:
            from edgecore.shared.engine.handle import EngineRequest
            # a line's choices are one group; a line's `cache_salt` scopes its prefix cache as on the edge (an
            # unsalted key's scope: NUL ‖ the salt; the batch API keeps no key salt yet)
            salt = None if parsed.cache_salt is None else f"\0{parsed.cache_salt}"
            request = EngineRequest(f"{batch_id}/{req['line']}/{i}", parsed.prompts[i // parsed.n], parsed.params[i],
                                    group=f"{batch_id}/{req['line']}", priority=BATCH_PRIORITY, cache_salt=salt)
            async for out in self.handle.generate(request, at_finish=True):
                results[i].add(out)

        self.metrics.batch_running.inc()
        tasks = [asyncio.create_task(choice(i)) for i in range(len(parsed.params))]
        try:
            await asyncio.gather(*tasks)
        except RequestError as exc:       # what only the engine checks (a grammar no text matches, KV capacity)
            self._record(req["line"], "error", {
                "id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": req["custom_id"], "response": None,
                "error": {"code": "invalid_request", "message": f"line {req['line']}: {exc}", "line": req["line"]}})
            return
        finally:
            for task in tasks:            # a refused line's other choices stop too
                task.cancel()
            self.metrics.batch_running.dec()
        self.metrics.batch_completed.inc()
        self.metrics.batch_prompt_tokens.inc(sum(len(p) for p in parsed.prompts))
        self.metrics.batch_generation_tokens.inc(sum(r.tokens for r in results))
        response = response_body(parsed, results, chat, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                                 int(time.time()), self.model_name, self.texts)
        self._record(req["line"], "done", {
            "id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": req["custom_id"],
            "response": {"status_code": 200, "request_id": rid, "body": response}, "error": None})

    # ---- finalization -------------------------------------------------------------
    def _finalize(self, batch_id: str, final: str) -> None:
        fields: dict[str, str] = {}
        for state, suffix, key in (("done", "output", "output_file_id"), ("error", "errors", "error_file_id")):
            lines = self.store.results(batch_id, state)
            if lines:
                file_id = f"file-{batch_id}-{suffix}"
                data = ("\n".join(lines) + "\n").encode()
                self.store.write_file(f"{batch_id}_{suffix}.jsonl", "batch_output", data, file_id)
                fields[key] = file_id
        self.store.set_status(batch_id, final, **fields)


def _tokenizer(handle: EngineHandle) -> Tokenizer:
    """The engine's tokenizer, as the shared OpenAI parsers and `TokenText` take it. A core without tokenizer
    files has None: they reach for it only for text (string prompts, chat, logprobs), which then fails."""
    return cast(Tokenizer, handle.tokenizer)


def _lines(path: Path) -> Iterator[bytes]:
    """The file's lines (bytes), read as they are needed."""
    with open(path, "rb") as f:
        yield from f
