"""The in-thread `EngineHandle`: runs an `LLMEngine` on its own thread and streams its outputs into asyncio.

Life cycle: `start()` spawns the engine thread, which first compiles the decode step when the
engine config asks for it (`started()` waits for that); coroutines use the handle's
typed methods (shared/engine/handle.py: `add`/`generate`, `abort`, `reserve`,
`write_kv`, `activate`, `read_kv`, `release`, prefix pins, stream routes),
each of which becomes one command the engine thread runs between two steps, in
the order they were made (the engine itself is never touched from two
threads). After each step and each batch of commands the thread publishes an
`EngineStats` snapshot, which `stats()` returns. A stream can be `redirect`ed to
a callback that the dispatch calls per output (no task switch per token). The
thread steps while there is work and sleeps on a condition otherwise; each
step's outputs reach the event loop in one `call_soon_threadsafe` (outputs of
requests opened with `collect` stay on the engine thread until the request
finishes). `stop()` ends the thread. A failure inside a step is delivered to
every waiting stream and command, so no caller hangs; the thread stays dead and
`on_failure` tells the node (a core stops serving, an edge exits for its supervisor).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any
from collections.abc import AsyncIterator, Callable

from edgecore.shared.engine.engine import LayerHook, LLMEngine
from edgecore.shared.engine.handle import EngineStats, FirstToken, Sink
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EngineDead
from edgecore.shared.kv.transfer import KVSlice, StreamRoute
from edgecore.shared.malloc import return_free_memory

log = logging.getLogger("edgecore.engine")
IDLE_TRIM_S = 1.0      # idle seconds after work before the heap's free pages are returned


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
        self._sinks: dict[str, Sink] = {}   # see redirect()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.on_outputs: Callable[[list[RequestOutput]], None] | None = None   # observer (metrics)
        self.on_failure: Callable[[BaseException], None] | None = None   # the node's reaction to a dead thread
        # Facts that never change (EngineHandle); everything else is asked of the engine thread.
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.block_size = engine.block_manager.block_size
        self.kv_bytes_per_token = engine.kv_bytes_per_token
        self._stats: EngineStats = engine.stats()

    # ---- lifecycle --------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop `start` was called on."""
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() has not been called")
        return self._loop

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="edgecore-engine", daemon=True)
        self._thread.start()

    async def started(self) -> None:
        """Wait until the engine thread is ready to step (its decode step compiled, if asked for); a node
        calls this before it serves. Raises EngineDead if the thread failed first."""
        await asyncio.shield(self._started)
        if self.error is not None:
            raise EngineDead(f"engine failed while starting: {self.error}")

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- facts and the published stats ---------------------------------------
    def stats(self) -> EngineStats:
        """The snapshot the engine thread published after its last step or batch of commands."""
        return self._stats

    # ---- ordinary requests (EngineHandle) ----------------------------------------
    async def add(self, request_id: str, prompt: list[int] | str, params: SamplingParams, *,
                  prefill_only: bool = False, priority: int = 0, collect: bool = False, group: str | None = None
                  ) -> asyncio.Queue:
        """Add a request; returns the queue its outputs arrive in (see `stream`)."""
        _, queue = await self._admit(
            request_id, lambda e: e.add_request(request_id, prompt, params, prefill_only, priority, group), collect)
        return queue

    async def add_if_uncached_below(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                                    limit: int, group: str | None = None) -> tuple[int, asyncio.Queue | None]:
        """Measure the prompt's cached prefix and, when fewer than `limit` tokens are left to compute, add
        the request right there (one engine turn, not two). Returns (cached tokens, the output queue or
        None when the request was not added)."""
        def place(e: LLMEngine) -> tuple[int, bool]:
            cached = e.cached_prefix(prompt_ids)
            if len(prompt_ids) - cached >= limit:
                return cached, False
            e.add_request(request_id, prompt_ids, params, group=group)
            return cached, True

        (cached, added), queue = await self._admit(request_id, place)
        if not added:
            self.close_stream(request_id)
            return cached, None
        return cached, queue

    async def generate(self, request_id: str, prompt: list[int] | str, params: SamplingParams, *,
                       prefill_only: bool = False, priority: int = 0, collect: bool = False,
                       group: str | None = None) -> AsyncIterator[RequestOutput]:
        try:
            queue = await self.add(request_id, prompt, params, prefill_only=prefill_only, priority=priority,
                                   collect=collect, group=group)
            async for out in self.stream(request_id, queue):
                yield out
        finally:
            self.close_stream(request_id)

    def open_stream(self, request_id: str, collect: bool = False) -> asyncio.Queue:
        """A queue of the request's outputs; with `collect`, they arrive together when it finishes
        (no per-token wake-ups for callers that only need the end result)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        if collect:
            self._collected[request_id] = []
        return queue

    def redirect(self, request_id: str, sink: Sink) -> None:
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
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._post(lambda e: e.abort(request_id))

    async def cached_prefix(self, prompt_ids: list[int]) -> int:
        return await self._call(lambda e: e.cached_prefix(prompt_ids))

    # ---- KV from outside ------------------------------------------------------------
    async def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      group: str | None = None) -> int:
        """Reserve blocks for a prompt whose KV will be written from outside; returns its locally cached
        leading tokens. Raises NoFreeBlocks when the cache is full."""
        return await self._call(lambda e: e.reserve(request_id, prompt_ids, params, group)[1])

    def write_kv(self, request_id: str, piece: KVSlice) -> None:
        self._post(lambda e: e.write_kv(request_id, piece))

    @property
    def first_layer_macs(self) -> int:
        return self.engine.runner.first_layer_macs

    async def write_first_layer_kv(self, request_id: str) -> None:
        await self._call(lambda e: e.write_first_layer_kv(request_id))

    async def activate(self, request_id: str, first: FirstToken) -> None:
        await self._call(lambda e: e.activate(request_id, first.token, first.logprob, first.top))

    async def push_token(self, request_id: str, token: FirstToken) -> bool:
        """A token decoded elsewhere (decode handover), in position order; True when it finished the request.
        Its output comes back with the reply and is dispatched here, not after the engine thread's next turn
        (one thread hand-off fewer on the way to the client)."""
        def push(e: LLMEngine) -> tuple[bool, list[RequestOutput]]:
            finished = e.push_token(request_id, token.token, token.logprob, token.top)
            return finished, e.take_pending(request_id)
        finished, outputs = await self._call(push)
        self._dispatch(outputs)
        return finished

    async def take_over(self, request_id: str, kv_until: int) -> None:
        await self._call(lambda e: e.take_over(request_id, kv_until))

    # ---- KV handed out --------------------------------------------------------------
    async def read_kv(self, request_id: str, start: int, end: int) -> list[KVSlice]:
        return await self._call(lambda e: e.read_kv_slices(request_id, start, end))

    def release(self, request_id: str) -> None:
        self._post(lambda e: e.release(request_id))

    def add_stream_route(self, stream_id: str, route: StreamRoute) -> None:
        self._post(lambda e: e.add_stream_route(stream_id, route))

    def drop_stream_route(self, stream_id: str) -> None:
        self._post(lambda e: e.drop_stream_route(stream_id))

    # ---- resident prefixes ----------------------------------------------------------
    async def pin_prefix(self, request_id: str) -> list[int]:
        """Pin a prefilled request's full blocks and release the request; returns the pinned blocks."""
        def pin(e: LLMEngine) -> list[int]:
            blocks = e.pin_prefix(request_id)
            e.release(request_id)
            return blocks
        return await self._call(pin)

    async def commit_prefix(self, request_id: str) -> list[int]:
        return await self._call(lambda e: e.commit_prefix(request_id))

    async def unpin(self, block_ids: list[int]) -> None:
        await self._call(lambda e: e.unpin(block_ids))

    # ---- a parallel core's ranks ----------------------------------------------------
    async def rank_stats(self) -> list[dict]:
        return await self._call(lambda e: e.runner.rank_stats())

    async def shutdown_ranks(self) -> None:
        await self._call(lambda e: e.runner.shutdown())

    # ---- commands (private: only the methods above run on the engine thread) ----------
    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result."""
        if self.error is not None:
            raise EngineDead(f"engine failed: {self.error}")
        fut = self.loop.create_future()
        with self._wake:
            self._commands.append((fn, fut))
            self._wake.notify()
        return await fut

    def _post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Like `_call` without waiting for the result (errors are logged)."""
        with self._wake:
            self._commands.append((fn, None))
            self._wake.notify()

    async def _admit(self, request_id: str, add: Callable[[LLMEngine], Any], collect: bool = False
                     ) -> tuple[Any, asyncio.Queue]:
        """Open the request's stream, then run `add(engine)` on the engine thread, which may add the request
        (the stream exists before any output can). Returns add's result and the stream's queue. Cancelled
        while `add` is queued, the request is aborted after it, so nothing runs on unobserved."""
        queue = self.open_stream(request_id, collect)
        try:
            return await self._call(add), queue
        except BaseException:
            self.close_stream(request_id)
            self.abort(request_id)
            raise

    # ---- engine thread ----------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        trimmed = True
        try:
            if self.threads:
                import torch
                torch.set_num_threads(self.threads)
            engine.compile_decode()
            self.loop.call_soon_threadsafe(_deliver, [(self._started, True, None)])
            while True:
                with self._wake:
                    while not self._commands and not engine.has_unfinished() and not self._stopping:
                        if not self._wake.wait(None if trimmed else IDLE_TRIM_S) and not trimmed:
                            return_free_memory()      # idle a while: a burst's heap pages go back
                            trimmed = True
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                if commands:
                    replies = self._run_commands(commands)
                    self._stats = engine.stats()      # before any reply: a caller sees its command's effect
                    if replies:
                        self.loop.call_soon_threadsafe(_deliver, replies)
                if engine.has_unfinished():
                    trimmed = False
                    outputs = self._hold_collected(engine.step(self.on_layer))
                    self._stats = engine.stats()      # one reference swap: readers see a whole snapshot
                    if outputs:
                        self.loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:   # a bug or resource failure: fail every stream, stay dead
            log.exception("engine thread failed")
            self.error = exc
            self.loop.call_soon_threadsafe(self._fail_all, exc)
            self.loop.call_soon_threadsafe(_deliver, [(self._started, True, None)])   # dead: commands say so

    def _run_commands(self, commands: list[tuple[Callable[[LLMEngine], Any], asyncio.Future | None]]
                      ) -> list[tuple[asyncio.Future, bool, Any]]:
        """Engine thread: run queued commands in order; returns (future, ok, result or exception) of those
        awaited (a failed posted command is logged)."""
        replies = []
        for fn, fut in commands:
            try:
                result = fn(self.engine)
            except Exception as exc:  # delivered to the awaiting coroutine
                if fut is not None:
                    replies.append((fut, False, exc))
                else:
                    log.warning("engine command failed: %s", exc)
            else:
                if fut is not None:
                    replies.append((fut, True, result))
        return replies

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
        try:
            for queue in self._streams.values():
                queue.put_nowait(exc)
            dead = EngineDead(f"engine failed: {exc}")
            for sink in list(self._sinks.values()):
                try:
                    sink(dead)
                except Exception:       # one consumer's bug must not keep the others (or the node) waiting
                    log.exception("output sink failed on the engine's failure")
            with self._wake:
                pending = list(self._commands)
                self._commands.clear()
            for _, fut in pending:
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDead(f"engine failed: {exc}"))
        finally:
            if self.on_failure is not None:
                self.on_failure(exc)


def _deliver(replies: list[tuple[asyncio.Future, bool, Any]]) -> None:
    for fut, ok, value in replies:
        if not fut.done():
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)
