"""Runs an `LLMEngine` on its own thread and streams its outputs into asyncio.

Life cycle: `start()` spawns the engine thread; coroutines call
`generate()` (an async iterator of `RequestOutput`), `abort()`, or `call(fn)`
to run any engine method between two steps (the engine itself is never
touched from two threads). A stream can be `redirect`ed to a callback that the
dispatch calls per output (no task switch per token). The thread steps while
there is work and sleeps on a condition otherwise; each step's outputs reach
the event loop in one `call_soon_threadsafe` (outputs of requests opened with
`collect` stay on the engine thread until the request finishes). `stop()` ends
the thread. A failure inside a step is delivered to every waiting stream, so no
caller hangs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any, AsyncIterator, Callable

from edgecore.shared.engine.engine import LayerHook, LLMEngine
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EngineDead

log = logging.getLogger("edgecore.engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_layer: LayerHook | None = None, threads: int | None = None):
        """threads: intra-op threads of the engine thread (see shared.env.reserve_threads_for_engine)."""
        self.engine = engine
        self.on_layer = on_layer
        self.threads = threads
        self._commands: deque[tuple[Callable, asyncio.Future | None]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, asyncio.Queue] = {}
        self._collected: dict[str, list[RequestOutput]] = {}   # requests delivered only when finished
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}   # see redirect()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.on_outputs: Callable[[list[RequestOutput]], None] | None = None   # observer (metrics)

    # ---- lifecycle --------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="edgecore-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- API for coroutines ------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result."""
        if self.error is not None:
            raise EngineDead(f"engine failed: {self.error}")
        fut = self._loop.create_future()
        with self._wake:
            self._commands.append((fn, fut))
            self._wake.notify()
        return await fut

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Like `call` without waiting for the result (errors are logged)."""
        with self._wake:
            self._commands.append((fn, None))
            self._wake.notify()

    def open_stream(self, request_id: str, collect: bool = False) -> asyncio.Queue:
        """A queue of the request's outputs; with `collect`, they arrive together when it finishes
        (no per-token wake-ups for callers that only need the end result)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        if collect:
            self._collected[request_id] = []
        return queue

    def redirect(self, request_id: str, sink: Callable[[RequestOutput | BaseException], None]) -> None:
        """From now on hand the request's outputs to `sink`, called from the dispatch itself: no queue and
        no task switch per token (outputs already queued go first). An engine failure reaches the sink as
        an exception. Event-loop thread only; `close_stream` ends it."""
        queue = self._streams.pop(request_id, None)
        self._collected.pop(request_id, None)
        self._sinks[request_id] = sink
        while queue is not None and not queue.empty():
            sink(queue.get_nowait())

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._collected.pop(request_id, None)
        self._sinks.pop(request_id, None)

    async def generate(self, request_id: str, prompt, params: SamplingParams, prefill_only: bool = False,
                       priority: int = 0, collect: bool = False) -> AsyncIterator[RequestOutput]:
        try:
            _, queue = await self.admit(
                request_id, lambda e: e.add_request(request_id, prompt, params, prefill_only, priority), collect)
            async for out in self.stream(request_id, queue):
                yield out
        finally:
            self.close_stream(request_id)

    async def admit(self, request_id: str, add: Callable[[LLMEngine], Any], collect: bool = False
                    ) -> tuple[Any, asyncio.Queue]:
        """Open the request's stream, then run `add(engine)` on the engine thread, which may add the request
        (the stream exists before any output can). Returns add's result and the stream's queue. Cancelled
        while `add` is queued, the request is aborted after it, so nothing runs on unobserved."""
        queue = self.open_stream(request_id, collect)
        try:
            return await self.call(add), queue
        except BaseException:
            self.close_stream(request_id)
            self.abort(request_id)
            raise

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs of a request already in the engine until it finishes; aborts it if the consumer leaves."""
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDead(f"engine failed: {item}")
                for out in (item if isinstance(item, list) else (item,)):
                    yield out
                    if out.finished:
                        finished = True
                        return
        finally:
            if not finished:
                self.post(lambda e: e.abort(request_id))

    def abort(self, request_id: str) -> None:
        self.post(lambda e: e.abort(request_id))

    # ---- engine thread ----------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        if self.threads:
            import torch
            torch.set_num_threads(self.threads)
        try:
            while True:
                with self._wake:
                    while not self._commands and not engine.has_unfinished() and not self._stopping:
                        self._wake.wait()
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    try:
                        result = fn(engine)
                    except Exception as exc:  # delivered to the awaiting coroutine
                        if fut is not None:
                            self._loop.call_soon_threadsafe(_set_exception, fut, exc)
                        else:
                            log.warning("engine command failed: %s", exc)
                    else:
                        if fut is not None:
                            self._loop.call_soon_threadsafe(_set_result, fut, result)
                if engine.has_unfinished():
                    outputs = self._hold_collected(engine.step(self.on_layer))
                    if outputs:
                        self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:   # a bug or resource failure: fail every stream, stay dead
            log.exception("engine thread failed")
            self.error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _hold_collected(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Engine thread: keep unfinished outputs of collected requests here, so a step whose outputs all
        belong to them (batch work) does not wake the event loop at all."""
        deliver = []
        for out in outputs:
            held = self._collected.get(out.request_id)
            if held is None or out.finished:
                deliver.append(out)
            else:
                held.append(out)
        return deliver

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        delivered = []
        sinks = self._sinks
        for out in outputs:
            sink = sinks.get(out.request_id)
            if sink is not None:
                delivered.append(out)
                try:
                    sink(out)
                except Exception:       # one consumer's bug must not stop the others' outputs
                    log.exception("output sink of %s failed", out.request_id)
                continue
            held = self._collected.get(out.request_id)
            if held is not None:        # a collected request finished (see _hold_collected): all at once
                self._collected[out.request_id] = []
                held = held + [out]
            delivered.extend(held or (out,))
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out if held is None else held)
        if self.on_outputs is not None:
            self.on_outputs(delivered)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(exc)
        dead = EngineDead(f"engine failed: {exc}")
        for sink in list(self._sinks.values()):
            sink(dead)
        with self._wake:
            pending = list(self._commands)
            self._commands.clear()
        for _, fut in pending:
            if fut is not None and not fut.done():
                fut.set_exception(EngineDead(f"engine failed: {exc}"))


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
