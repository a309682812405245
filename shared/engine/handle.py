"""The engine handle: everything a node may ask of an engine, with typed arguments and results.

Life cycle of the seam: a node (edge engine, core prefill service, batch
runner, contexts, control port) holds an `EngineHandle` and nothing else of the
engine. Requests enter with `add` / `generate` (outputs stream back), leave with
`abort`; each declares its fairness `group` (the scheduler shares a step's budget between groups; by default
a request is a group of its own); the disaggregation entry points are `reserve` → `write_kv`* (and
`write_first_layer_kv`, layer 0 computed here) → `activate` (KV from outside;
with decode handover `reserve` → `push_token`* and `write_kv`* → `take_over`) and prefill-only requests → `read_kv` → `release`
(KV handed out); `pin_prefix` / `commit_prefix` / `unpin` keep prefixes
resident. Stream routes (`add_stream_route`, `drop_stream_route`) tell a
parallel core's ranks where to send their KV. `stats()` returns the snapshot the
engine thread published after its last step or command: no caller reads engine
state from another thread. `AsyncEngine` implements the handle in-thread; the
edge's HTTP frontend reaches its engine process through `EdgeService`
(edge/service.py) instead, which is served over typed messages (edge/ipc.py).
"""

from __future__ import annotations

import asyncio
from typing import Protocol
from collections.abc import AsyncIterator, Callable

import msgspec

from edgecore.shared.config import ModelConfig
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import KVSlice, StreamRoute
from edgecore.shared.tokenizer import Tokenizer


class EngineStats(msgspec.Struct, frozen=True):
    """What the engine thread publishes after each step (and after each batch of commands)."""
    running: int = 0
    waiting: int = 0
    prefilled: int = 0          # prefill-only requests done, KV kept for a reader
    awaiting_kv: int = 0        # blocks reserved, KV being written from outside
    requests: int = 0           # every request the engine holds
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_cached: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    preemptions: int = 0
    iteration_tokens: tuple[int, ...] = ()   # tokens per step: count per bucket of shared/metrics.py (last: above)
    iteration_tokens_sum: int = 0
    prefix_caching: bool = True
    blocks_touched: int = 0     # blocks ever used: the KV pool's resident part on CPU (it maps memory lazily)
    kv_block_bytes: int = 0     # bytes of one block (all layers, K and V)
    weights_bytes: int = 0
    compiled_steps: int = 0     # decode steps run by the compiled step (`--compile`); 0 without it

    @property
    def load(self) -> int:
        """Requests queued or running (what a core reports to edges as its load)."""
        return self.running + self.waiting

    def as_dict(self) -> dict:
        """The /stats form; `parked` is every request holding KV outside the batch."""
        out = msgspec.structs.asdict(self)
        del out["iteration_tokens"]             # a histogram: /metrics has it
        out["parked"] = self.prefilled + self.awaiting_kv
        return out


class FirstToken(msgspec.Struct, frozen=True):
    """A request's first token, sampled where it was prefilled (or any token decoded there, `push_token`)."""
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = []


Sink = Callable[[RequestOutput | BaseException], None]


class EngineHandle(Protocol):
    """Everything a node may ask of an engine. Coroutines wait for the engine thread; plain methods queue
    the command (in order with every other command) and return at once."""

    config: ModelConfig                 # immutable facts about the engine's model
    tokenizer: Tokenizer | None
    max_model_len: int
    block_size: int
    kv_bytes_per_token: int

    @property
    def alive(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    # ---- ordinary requests ----------------------------------------------------------------------
    async def add(self, request_id: str, prompt: list[int] | str, params: SamplingParams, *,
                  prefill_only: bool = False, priority: int = 0, collect: bool = False, group: str | None = None
                  ) -> asyncio.Queue: ...

    async def add_if_uncached_below(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                                    limit: int, group: str | None = None) -> tuple[int, asyncio.Queue | None]: ...

    def generate(self, request_id: str, prompt: list[int] | str, params: SamplingParams, *,
                 prefill_only: bool = False, priority: int = 0, collect: bool = False, group: str | None = None
                 ) -> AsyncIterator[RequestOutput]: ...

    def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]: ...

    def open_stream(self, request_id: str, collect: bool = False) -> asyncio.Queue: ...

    def redirect(self, request_id: str, sink: Sink) -> None: ...

    def close_stream(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None: ...

    async def cached_prefix(self, prompt_ids: list[int]) -> int: ...

    # ---- KV from outside ------------------------------------------------------------------------
    async def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      group: str | None = None) -> int: ...

    def write_kv(self, request_id: str, piece: KVSlice) -> None: ...

    # Multiply-adds per token of computing layer 0's K/V locally (0: this engine cannot), and doing so for a
    # reserved request's uncached tokens instead of receiving them (shared/kv/transfer.py `EDGE_LAYERS`).
    @property
    def first_layer_macs(self) -> int: ...

    async def write_first_layer_kv(self, request_id: str) -> None: ...

    async def activate(self, request_id: str, first: FirstToken) -> None: ...

    async def push_token(self, request_id: str, token: FirstToken) -> bool: ...

    async def take_over(self, request_id: str, kv_until: int) -> None: ...

    # ---- KV handed out --------------------------------------------------------------------------
    async def read_kv(self, request_id: str, start: int, end: int) -> list[KVSlice]: ...

    def release(self, request_id: str) -> None: ...

    def add_stream_route(self, stream_id: str, route: StreamRoute) -> None: ...

    def drop_stream_route(self, stream_id: str) -> None: ...

    # ---- resident prefixes ----------------------------------------------------------------------
    async def pin_prefix(self, request_id: str) -> list[int]: ...

    async def commit_prefix(self, request_id: str) -> list[int]: ...

    async def unpin(self, block_ids: list[int]) -> None: ...

    # ---- a parallel core's ranks ----------------------------------------------------------------
    async def rank_stats(self) -> list[dict]: ...

    async def shutdown_ranks(self) -> None: ...
