"""`FakeHandle`: an `EngineHandle` without a model, for unit tests of what nodes do with their engine.

It records every call (`calls`: (method, arguments) in order; `requests`: the admitted `EngineRequest`s by
id; `written`: the KV slices written) and answers from a script: `outputs[request_id]` are the outputs a
request produces (by default one finished output, token 0), emitted to its sink on the next event-loop turn after `submit` (or after `activate` for a
reserved one), `kv[request_id]` what `read_kv` hands out, `cached` the prefix `reserve` / `cached_prefix`
report, `refuse` the error `submit` / `reserve` raise. Outputs are built with `output(...)`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.engine.handle import (EngineHandle, EngineRequest, EngineStats, FirstToken, OutputQueue,
                                           OutputSink, read_outputs)
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.kv.transfer import KVSlice, DirectRoute
from edgecore.shared.text.tokenizer import Tokenizer
from tests.conftest import MODEL_DIR


def output(request_id: str, token: int, *, finished: bool = True, reason: str | None = "length",
           prompt_tokens: int = 0, cached: int = 0, outputs_so_far: int = 1) -> RequestOutput:
    """One scripted output: `token` sampled for `request_id`."""
    return RequestOutput(request_id, [token], "", finished, reason if finished else None, None, prompt_tokens,
                         cached, outputs_so_far)


class FakeHandle:
    """A scripted `EngineHandle` (see the module's docstring); facts are the bundled model's config."""

    def __init__(self, config: ModelConfig | None = None, *, block_size: int = 16, cached: int = 0,
                 blocks_total: int = 256) -> None:
        self.config = config or ModelConfig.from_dir(MODEL_DIR)
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = self.config.max_position_embeddings
        self.block_size = block_size
        self.kv_bytes_per_token = self.config.kv_bytes_per_token(1)
        self.layer0_macs_per_token = 0
        self.cached = cached
        self.published = EngineStats(blocks_total=blocks_total)
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.kv: dict[str, list[KVSlice]] = {}
        self.refuse: Exception | None = None
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.requests: dict[str, EngineRequest] = {}
        self.sinks: dict[str, OutputSink] = {}
        self.written: list[KVSlice] = []
        self._blocks = itertools.count()

    @property
    def alive(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return self.published

    def _record(self, name: str, *args: object) -> None:
        self.calls.append((name, args))

    def called(self, name: str) -> list[tuple[object, ...]]:
        """The arguments of every call of `name`, in order."""
        return [args for n, args in self.calls if n == name]

    def _emit_script(self, request_id: str) -> None:
        """On the next loop turn (as the engine thread's outputs arrive), the request's scripted outputs."""
        def emit() -> None:
            for out in self.outputs.get(request_id) or [output(request_id, 0)]:
                sink = self.sinks.get(request_id)
                if sink is None:
                    return
                if out.finished:
                    del self.sinks[request_id]
                sink.emit(out)
        asyncio.get_running_loop().call_soon(emit)

    # ---- ordinary requests ----------------------------------------------------------------------
    async def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        self._record("submit", request, sink)
        if self.refuse is not None:
            raise self.refuse
        self.requests[request.request_id] = request
        self.sinks[request.request_id] = sink
        self._emit_script(request.request_id)

    async def submit_if_uncached_below(self, request: EngineRequest, sink: OutputSink, limit: int
                                       ) -> tuple[int, bool]:
        self._record("submit_if_uncached_below", request, sink, limit)
        if len(request.prompt) - self.cached >= limit:
            return self.cached, False
        await self.submit(request, sink)
        return self.cached, True

    async def generate(self, request: EngineRequest, *, at_finish: bool = False) -> AsyncIterator[RequestOutput]:
        queue: OutputQueue = asyncio.Queue()
        await self.submit(request, OutputSink.queue(queue, at_finish))
        async for out in read_outputs(queue, lambda: self.abort(request.request_id)):
            yield out

    def abort(self, request_id: str) -> None:
        self._record("abort", request_id)
        self.sinks.pop(request_id, None)

    async def cached_prefix(self, prompt_ids: list[int], cache_salt: str | None = None) -> int:
        self._record("cached_prefix", prompt_ids)
        return self.cached

    # ---- KV from outside ------------------------------------------------------------------------
    async def reserve(self, request: EngineRequest, sink: OutputSink | None) -> int:
        self._record("reserve", request, sink)
        if self.refuse is not None:
            raise self.refuse
        self.requests[request.request_id] = request
        if sink is not None:
            self.sinks[request.request_id] = sink
        return self.cached

    def write_kv(self, request_id: str, piece: KVSlice) -> None:
        self._record("write_kv", request_id, piece)
        self.written.append(piece)

    async def write_first_layer_kv(self, request_id: str) -> None:
        self._record("write_first_layer_kv", request_id)

    async def activate(self, request_id: str, first: FirstToken) -> None:
        self._record("activate", request_id, first)
        self._emit_script(request_id)

    async def push_token(self, request_id: str, token: FirstToken) -> bool:
        self._record("push_token", request_id, token)
        return False

    async def take_over(self, request_id: str, kv_until: int) -> None:
        self._record("take_over", request_id, kv_until)

    # ---- KV handed out --------------------------------------------------------------------------
    async def read_kv(self, request_id: str, start: int, end: int) -> list[KVSlice]:
        self._record("read_kv", request_id, start, end)
        return self.kv.get(request_id, [])

    def release(self, request_id: str) -> None:
        self._record("release", request_id)
        self.sinks.pop(request_id, None)

    def add_direct_route(self, stream_id: str, route: DirectRoute) -> None:
        self._record("add_direct_route", stream_id, route)

    def drop_direct_route(self, stream_id: str) -> None:
        self._record("drop_direct_route", stream_id)

    # ---- resident prefixes ----------------------------------------------------------------------
    async def pin_prefix(self, request_id: str) -> list[int]:
        """A prefilled request's full blocks: fresh block ids, one per `block_size` prompt tokens."""
        self._record("pin_prefix", request_id)
        prompt = self.requests[request_id].prompt
        return [next(self._blocks) for _ in range(len(prompt) // self.block_size)]

    async def commit_prefix(self, request_id: str) -> list[int]:
        self._record("commit_prefix", request_id)
        prompt = self.requests[request_id].prompt
        return [next(self._blocks) for _ in range(len(prompt) // self.block_size)]

    async def unpin(self, block_ids: list[int]) -> None:
        self._record("unpin", block_ids)

    # ---- a parallel core's ranks ----------------------------------------------------------------
    async def rank_stats(self) -> list[dict]:
        return []

    async def shutdown_ranks(self) -> None:
        self._record("shutdown_ranks")


def _implements_handle(fake: FakeHandle) -> EngineHandle:
    """Never called: `mypy tests/shared/fake_handle.py` proves here that the fake implements `EngineHandle`."""
    return fake
