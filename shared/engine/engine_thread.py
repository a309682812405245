"""The in-thread `EngineHandle`: runs an `LLMEngine` on its own thread and delivers its outputs into asyncio.

Life cycle: `start()` spawns the engine thread, which first compiles the decode step when the
engine config asks for it (`started()` waits for that); coroutines use the handle's
typed methods (shared/engine/handle.py: `submit`/`generate`, `abort`, `reserve`,
`write_kv`, `activate`, `read_kv`, `release`, prefix pins, stream routes),
each of which becomes one typed command (`_call`: a function of the engine and its
result type) that the engine thread runs between two steps, in the order they
were made (the engine itself is never touched from two threads). After each step
and each batch of commands the thread publishes an `EngineStats` snapshot, which
`stats()` returns; facts that never change are read once, here, before the thread
starts. The thread steps while there is work and sleeps on a condition
otherwise; each step's outputs reach the event loop in one `call_soon_threadsafe`,
where `_dispatch` hands each to its request's `OutputSink` (no task switch per
token). `stop()` ends the thread. A failure inside a step is delivered to every
sink and waiting command, so no caller hangs; the thread stays dead and
`on_failure` tells the node (a core stops serving, an edge exits for its supervisor).

Who owns what: `_sinks` (request id → sink) belongs to the event-loop thread: a
sink is registered before its admission command is queued (so it exists before
any output can reach the loop) and dropped there after the request's last output,
the engine's failure, `abort` or `release`. `_held` (the outputs of `at_finish`
requests, kept until they finish) belongs to the engine thread: entered by the
admission command, emptied by the step that finishes the request, by `abort` and
by `release`. `_commands` is the only state both threads touch, under `_wake`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from edgecore.shared.engine import block_share
from edgecore.shared.engine.engine import LayerHook, LLMEngine
from edgecore.shared.engine.tier_loads import pool_shape
from edgecore.shared.engine.handle import (EngineHandle, EngineRequest, EngineStats, FirstToken, OutputQueue,
                                           OutputSink, read_outputs)
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.errors import EngineDead
from edgecore.shared.kv.transfer import KVSlice, DirectRoute
from edgecore.shared.node.malloc import return_free_memory

log = logging.getLogger("edgecore.engine")
IDLE_TRIM_S = 1.0      # idle seconds after work before the heap's free pages are returned
TIER_PREFETCH_WAIT_S = 2.0   # a reservation waits this long at most for its prefix from the disk KV tier

T = TypeVar("T")
Reply = Callable[[], None]                       # run on the event loop: settles a command's future


@dataclass(frozen=True)
class Command:
    """One command for the engine thread. `run(engine)` runs there between steps and returns the reply the
    event loop runs (None: nobody waits); `refuse(error)` settles the waiting caller instead if the thread
    died before running it (None: nobody waits)."""
    run: Callable[[LLMEngine], Reply | None]
    refuse: Callable[[BaseException], None] | None = None


class EngineThread:
    def __init__(self, engine: LLMEngine, on_layer: LayerHook | None = None, threads: int | None = None):
        """threads: intra-op threads of the engine thread (see shared.env.reserve_threads_for_engine)."""
        self.engine = engine
        self.on_layer = on_layer
        self.threads = threads
        self._tier = engine.tier is not None       # (read once: a disk KV tier's prefixes are read before `reserve`)
        self._commands: deque[Command] = deque()
        self._wake = threading.Condition()
        self._sinks: dict[str, OutputSink] = {}              # event-loop thread only
        self._held: dict[str, list[RequestOutput]] = {}      # engine thread only (at_finish requests)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started: asyncio.Future[None] | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.on_outputs: Callable[[list[RequestOutput]], None] | None = None   # observer (metrics)
        self.on_failure: Callable[[BaseException], None] | None = None   # the node's reaction to a dead thread
        # Facts that never change (EngineHandle), read before the thread starts; the rest is asked of it.
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.block_size = engine.block_manager.block_size
        self.kv_bytes_per_token = engine.kv_bytes_per_token
        self.block_shape = None if engine.pool.layout.latent else pool_shape(engine.pool)   # (blocks pulled by peers)
        self.layer0_macs_per_token: int = engine.runner.layer0_macs_per_token
        self._stats: EngineStats = engine.stats()

    # ---- lifecycle --------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop `start` was called on."""
        if self._loop is None:
            raise RuntimeError("EngineThread.start() has not been called")
        return self._loop

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="edgecore-engine", daemon=True)
        self._thread.start()

    async def started(self) -> None:
        """Wait until the engine thread is ready to step (its decode step compiled, if asked for); a node
        calls this before it serves. Raises EngineDead if the thread failed first."""
        if self._started is None:
            raise RuntimeError("EngineThread.start() has not been called")
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

    def stats(self) -> EngineStats:
        """The snapshot the engine thread published after its last step or batch of commands."""
        return self._stats

    # ---- ordinary requests (EngineHandle) ----------------------------------------
    async def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        """Admit `request`, its outputs going to `sink` (see EngineHandle.submit)."""
        def add(e: LLMEngine) -> None:
            r = request
            e.add_request(r.request_id, r.prompt, r.params, r.prefill_only, r.priority, r.group, r.cache_salt,
                          r.tenant, r.weight, r.adapter)
            self._hold_for(r.request_id, sink)
        await self._admit(request.request_id, sink, add)

    async def submit_if_uncached_below(self, request: EngineRequest, sink: OutputSink, limit: int
                                       ) -> tuple[int, bool]:
        """Measure the prompt's cached prefix and, when fewer than `limit` tokens are left to compute, admit the
        request right there (one engine turn, not two). Returns (cached tokens, whether it was admitted)."""
        prompt_ids = request.prompt
        assert isinstance(prompt_ids, list), "a prompt measured against the prefix cache is token ids"

        def place(e: LLMEngine) -> tuple[int, bool]:
            cached = e.cached_prefix(prompt_ids, request.cache_salt, request.adapter)
            if len(prompt_ids) - cached >= limit:
                return cached, False
            e.add_request(request.request_id, prompt_ids, request.params, request.prefill_only, request.priority,
                          request.group, request.cache_salt, request.tenant, request.weight, request.adapter)
            self._hold_for(request.request_id, sink)
            return cached, True

        cached, added = await self._admit(request.request_id, sink, place)
        if not added:
            self._drop_sink(request.request_id, sink)
        return cached, added

    async def generate(self, request: EngineRequest, *, at_finish: bool = False) -> AsyncIterator[RequestOutput]:
        """`submit` with a queue sink, as an async iterator; a consumer that leaves early aborts the request."""
        queue: OutputQueue = asyncio.Queue()
        await self.submit(request, OutputSink.queue(queue, at_finish))
        async for out in read_outputs(queue, lambda: self.abort(request.request_id)):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort the request; its sink gets nothing more."""
        self._sinks.pop(request_id, None)

        def abort(e: LLMEngine) -> None:
            self._held.pop(request_id, None)
            e.abort(request_id)
        self._post(abort)

    async def cached_prefix(self, prompt_ids: list[int], cache_salt: str | None = None,
                            adapter: str | None = None) -> int:
        """(`adapter`: measured under a LoRA adapter's scope, shared/models/lora.py; beyond EngineHandle's form.)"""
        return await self._call(lambda e: e.cached_prefix(prompt_ids, cache_salt, adapter))

    async def cache_changes(self) -> dict[int, bool]:
        """The prefix cache's block hashes gained (True) and lost (False) since the previous call; the first call
        gives every hash cached now (`BlockManager.take_journal`; beyond EngineHandle's form: a core's digest)."""
        return await self._call(lambda e: e.block_manager.take_journal())

    async def pool_blocks(self, hashes: list[int], max_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the leading cached blocks under `hashes` (shared/engine/block_share.py; a peer edge pulls them)."""
        return await self._call(lambda e: block_share.pool_blocks(e, hashes, max_bytes))

    async def adopt_blocks(self, hashes: list[int], salt: str | None,
                           blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Cache blocks pulled from a peer under their hashes; how many now are (shared/engine/block_share.py)."""
        return await self._call(lambda e: block_share.adopt_blocks(e, hashes, salt, blocks))

    # ---- LoRA adapters (shared/models/lora.py; not part of EngineHandle: the nodes that serve them ask) ----------
    async def load_adapter(self, name: str, path: str) -> str:
        """Load a PEFT adapter; its fingerprint. Raises AdapterError (nothing loaded). Its files are read, hashed
        and checked on a worker thread (a slow disk or a FIFO blocks no step); only the slot and the stacks
        change on the engine thread, between steps."""
        adapter = await asyncio.to_thread(self.engine.lora.read, name, path)
        return await self._call(lambda e: e.lora.add(adapter).fingerprint)

    async def unload_adapter(self, name: str) -> None:
        await self._call(lambda e: e.lora.unload(name))

    # ---- KV from outside ------------------------------------------------------------
    async def reserve(self, request: EngineRequest, sink: OutputSink | None) -> int:
        """Reserve blocks for a prompt whose KV will be written from outside; returns its locally cached
        leading tokens. Raises NoFreeBlocks when the cache is full."""
        if self._tier:          # the prefix's blocks on disk: read (on the tier's thread) before reserving
            def prefetch(e: LLMEngine) -> Future[Any] | None:
                return e.prefetch_prefix(request.request_id, request.prompt, request.cache_salt, request.adapter)
            loading = await self._call(prefetch)
            if loading is not None:
                await asyncio.wait({asyncio.wrap_future(loading)}, timeout=TIER_PREFETCH_WAIT_S)

        def reserve(e: LLMEngine) -> int:
            cached = e.reserve(request.request_id, request.prompt, request.params, request.group,
                               request.cache_salt, request.tenant, request.weight, request.priority,
                               request.adapter)[1]
            if sink is not None:
                self._hold_for(request.request_id, sink)
            return cached
        if sink is None:
            return await self._call(reserve)
        return await self._admit(request.request_id, sink, reserve)

    def write_kv(self, request_id: str, piece: KVSlice) -> None:
        self._post(lambda e: e.write_kv(request_id, piece))

    async def write_first_layer_kv(self, request_id: str) -> None:
        await self._call(lambda e: e.write_first_layer_kv(request_id))

    async def activate(self, request_id: str, first: FirstToken) -> None:
        await self._call(lambda e: e.activate(request_id, first.token, first.logprob, first.top,
                                                  first.cached_tokens))

    async def push_token(self, request_id: str, token: FirstToken) -> bool:
        """A token decoded elsewhere (decode handover), in position order; True when it finished the request.
        Its output comes back with the reply and is dispatched here, not after the engine thread's next turn
        (one thread hand-off fewer on the way to the client)."""
        def push(e: LLMEngine) -> tuple[bool, list[RequestOutput]]:
            finished = e.push_token(request_id, token.token, token.logprob, token.top, token.cached_tokens)
            return finished, self._hold(e.take_pending(request_id))
        finished, outputs = await self._call(push)
        self._dispatch(outputs)
        return finished

    async def take_over(self, request_id: str, kv_until: int) -> None:
        await self._call(lambda e: e.take_over(request_id, kv_until))

    # ---- KV handed out --------------------------------------------------------------
    async def read_kv(self, request_id: str, start: int, end: int) -> list[KVSlice]:
        return await self._call(lambda e: e.read_kv_slices(request_id, start, end))

    def release(self, request_id: str) -> None:
        """Free the request's KV (it ends); its sink gets nothing more."""
        self._sinks.pop(request_id, None)

        def release(e: LLMEngine) -> None:
            self._held.pop(request_id, None)
            e.release(request_id)
        self._post(release)

    def add_direct_route(self, stream_id: str, route: DirectRoute) -> None:
        self._post(lambda e: e.add_direct_route(stream_id, route))

    def drop_direct_route(self, stream_id: str) -> None:
        self._post(lambda e: e.drop_direct_route(stream_id))

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
    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; return its result (or raise its exception)."""
        if self.error is not None:
            raise EngineDead(f"engine failed: {self.error}")
        fut: asyncio.Future[T] = self.loop.create_future()

        def run(e: LLMEngine) -> Reply:
            try:
                result = fn(e)
            except Exception as exc:      # delivered to the awaiting coroutine
                return partial(_settle_error, fut, exc)      # (`exc` is unbound after the block)
            return partial(_settle, fut, result)
        self._queue(Command(run, lambda exc: _settle_error(fut, exc)))
        return await fut

    def _post(self, fn: Callable[[LLMEngine], None]) -> None:
        """Like `_call` without waiting for the result (errors are logged)."""
        def run(e: LLMEngine) -> None:
            try:
                fn(e)
            except Exception as exc:
                log.warning("engine command failed: %s", exc)
        self._queue(Command(run))

    def _queue(self, command: Command) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    async def _admit(self, request_id: str, sink: OutputSink, add: Callable[[LLMEngine], T]) -> T:
        """Register the request's sink, then run `add(engine)` on the engine thread, which may add the request
        (the sink exists before any output can). Returns add's result. If `add` fails the sink is dropped;
        cancelled while `add` is queued, the request is aborted after it, so nothing runs on unobserved."""
        self._sinks[request_id] = sink
        try:
            return await self._call(add)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._drop_sink(request_id, sink)
            raise

    def _drop_sink(self, request_id: str, sink: OutputSink) -> None:
        if self._sinks.get(request_id) is sink:
            del self._sinks[request_id]

    # ---- engine thread ----------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        trimmed = True
        try:
            if self.threads:
                import torch
                torch.set_num_threads(self.threads)
            engine.compile_decode()
            self.loop.call_soon_threadsafe(self._set_started)
            while True:
                with self._wake:
                    while not self._commands and not engine.has_unfinished() and not self._stopping:
                        if not self._wake.wait(None if trimmed else IDLE_TRIM_S) and not trimmed:
                            return_free_memory()      # idle a while: a burst's heap pages go back
                            trimmed = True
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                if commands:
                    replies = [r for r in (command.run(engine) for command in commands) if r is not None]
                    self._stats = engine.stats()      # before any reply: a caller sees its command's effect
                    if replies:
                        self.loop.call_soon_threadsafe(_run_all, replies)
                if engine.has_unfinished():
                    trimmed = False
                    outputs = self._hold(engine.step(self.on_layer))
                    self._stats = engine.stats()      # one reference swap: readers see a whole snapshot
                    if outputs:
                        self.loop.call_soon_threadsafe(self._dispatch, outputs)
            engine.close()          # stopped: the disk KV tier takes the blocks still cached (bounded)
        except BaseException as exc:   # a bug or resource failure: fail every sink, stay dead
            log.exception("engine thread failed")
            self.error = exc
            self.loop.call_soon_threadsafe(self._fail_all, exc)
            self.loop.call_soon_threadsafe(self._set_started)   # dead: `started` and commands say so

    def _hold_for(self, request_id: str, sink: OutputSink) -> None:
        """Engine thread, in the admission command: an `at_finish` request's outputs are kept here."""
        if sink.at_finish:
            self._held[request_id] = []

    def _hold(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Engine thread: keep unfinished outputs of `at_finish` requests here, so a step whose outputs all
        belong to them (batch work) does not wake the event loop at all; a finished one brings them all."""
        if not self._held:
            return outputs
        deliver = []
        for out in outputs:
            held = self._held.get(out.request_id)
            if held is None:
                deliver.append(out)
            elif out.finished:
                del self._held[out.request_id]
                deliver.extend(held)
                deliver.append(out)
            else:
                held.append(out)
        return deliver

    # ---- event loop -------------------------------------------------------
    def _set_started(self) -> None:
        if self._started is not None and not self._started.done():
            self._started.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its request's sink; a finished request's sink is dropped after its last one."""
        sinks = self._sinks
        for out in outputs:
            sink = sinks.pop(out.request_id, None) if out.finished else sinks.get(out.request_id)
            if sink is None:
                continue
            try:
                sink.emit(out)
            except Exception:       # one consumer's bug must not stop the others' outputs
                log.exception("output sink of %s failed", out.request_id)
        if self.on_outputs is not None:
            self.on_outputs(outputs)

    def _fail_all(self, exc: BaseException) -> None:
        try:
            sinks, self._sinks = list(self._sinks.values()), {}
            for sink in sinks:
                try:
                    sink.emit(EngineDead(f"engine failed: {exc}"))
                except Exception:       # one consumer's bug must not keep the others (or the node) waiting
                    log.exception("output sink failed on the engine's failure")
            with self._wake:
                pending = list(self._commands)
                self._commands.clear()
            for command in pending:       # never run: each awaited one fails with EngineDead
                if command.refuse is not None:
                    command.refuse(EngineDead(f"engine failed: {exc}"))
        finally:
            if self.on_failure is not None:
                self.on_failure(exc)


def _settle(fut: asyncio.Future[T], value: T) -> None:
    if not fut.done():
        fut.set_result(value)


def _settle_error(fut: asyncio.Future[T], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _run_all(replies: list[Reply]) -> None:
    for reply in replies:
        reply()


def _satisfies_handle(engine: EngineThread) -> EngineHandle:
    """Never called: the type checker proves here that `EngineThread` implements `EngineHandle`."""
    return engine
