"""The engine handle: everything a node may ask of an engine, with typed arguments and results.

Life cycle of the seam: a node (edge engine, core prefill service, batch
runner, contexts, control port) holds an `EngineHandle` and nothing else of the
engine. A request enters as one typed `EngineRequest` (id, prompt, sampling
parameters, fairness `group` — the scheduler shares a step's budget between
groups; by default a request is a group of its own — priority, prefill-only,
`cache_salt` — the prefix cache's scope: blocks are reused only between requests
with the same salt, and `cached_prefix` measures under one)
together with the one `OutputSink` its outputs go to, chosen at admission:
`submit(request, sink)`; `generate(request)` is the async-iterator form over a
queue sink. A sink gets each output (or, with `at_finish`, all of them together
when the request finishes, held on the engine thread until then) and
`EngineDead` if the engine fails; it is dropped after the request's last output,
the failure, or the caller's `abort` / `release`. The disaggregation entry
points are `reserve(request, sink)` → `write_kv`* (and `write_first_layer_kv`,
layer 0 computed here) → `activate` (KV from outside; with decode handover
`reserve` → `push_token`* and `write_kv`* → `take_over`) and prefill-only
requests → `read_kv` → `release` (KV handed out); `pin_prefix` /
`commit_prefix` / `unpin` keep prefixes resident. Stream routes
(`add_direct_route`, `drop_direct_route`) tell a parallel core's ranks where to
send their KV. Facts that never change (config, block size, layer 0's cost) are
published once; `stats()` returns the snapshot the engine thread published after
its last step or command: no caller reads engine state from another thread.
`EngineThread` implements the handle in-thread; the edge's HTTP frontend reaches
its engine process through `EdgeService` (edge/service.py) instead, which is
served over typed messages (edge/ipc.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol
from collections.abc import AsyncIterator, Callable

import msgspec

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EngineDead
from edgecore.shared.kv.transfer import KVSlice, DirectRoute
from edgecore.shared.text.tokenizer import Tokenizer


class EngineStats(msgspec.Struct, frozen=True):
    """What the engine thread publishes after each step (and after each batch of commands)."""
    running: int = 0
    waiting: int = 0
    prefill_tokens_left: int = 0    # prompt tokens of running and waiting requests not computed yet (the prefill queue)
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
    iteration_tokens: tuple[int, ...] = ()   # tokens per step: count per bucket of shared/node/metrics.py (last: above)
    iteration_tokens_sum: int = 0
    prefix_caching: bool = True
    blocks_touched: int = 0     # blocks ever used: the KV pool's resident part on CPU (it maps memory lazily)
    kv_block_bytes: int = 0     # bytes of one block (all layers, K and V)
    weights_bytes: int = 0
    compiled_steps: int = 0     # decode steps run by the compiled step (`--compile`); 0 without it
    # speculative decoding (shared/engine/speculative.py; all 0 without it): steps a sequence drafted in, tokens
    # drafted, drafts accepted (acceptance rate: accepted / drafted)
    speculative: bool = False
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the disk KV tier (shared/kv/tier.py; all 0 without one): cumulative blocks, bytes and seconds, its state
    tier_hit_blocks: int = 0          # blocks read back (verified) instead of recomputed
    tier_miss_blocks: int = 0         # blocks after the pool's prefix looked up and not found (or bad)
    tier_read_bytes: int = 0
    tier_read_seconds: float = 0.0    # reader thread time: read speed = bytes / seconds
    tier_written_blocks: int = 0
    tier_written_bytes: int = 0
    tier_dropped_blocks: int = 0      # spills not stored: the writer was behind, or the write failed
    tier_errors: int = 0              # I/O errors (writes, reads, deletions)
    tier_removed_files: int = 0       # corrupted, truncated or foreign files removed
    tier_used_bytes: int = 0
    tier_capacity_bytes: int = 0
    tier_files: int = 0
    tier_healthy: bool = True         # False while writes to its directory fail

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
    cached_tokens: int | None = None   # with the first token: prompt tokens the prefilling node did not compute



@dataclass(frozen=True)
class EngineRequest:
    """One request as it enters an engine (`submit`, `generate`, `reserve`)."""
    request_id: str
    prompt: list[int] | str                 # token ids, or text the engine's tokenizer encodes
    params: SamplingParams
    group: str | None = None                # fairness group (`Sequence.group`); None: the request alone
    priority: int = 0                       # lower runs first (batch work sets a higher number)
    prefill_only: bool = False              # end PREFILLED with the KV kept for a reader (`read_kv`, `release`)
    # Prefix-cache scope: cached blocks are reused only between requests with the same salt (mixed into the
    # first block's hash, shared/kv/block_manager.py); None: unsalted, shared by every request without one.
    cache_salt: str | None = None
    # The tenant the request belongs to (shared/node/tenants.py; None: none) and its weight: the scheduler shares each
    # step between tenants by weight, then between their groups (`Sequence.tenant`, `Sequence.weight`).
    tenant: str | None = None
    adapter: str | None = None              # a loaded LoRA adapter's name (shared/models/lora.py); None: the base model
    weight: float = 1.0
    traceparent: str | None = None          # W3C trace context of the span it runs under (shared/node/tracing.py)


Output = RequestOutput | EngineDead     # what a sink receives: an output, or the engine's failure (the last item)
Emit = Callable[[Output], None]
OutputQueue = asyncio.Queue[Output]


@dataclass(frozen=True)
class OutputSink:
    """Where one request's outputs go, chosen at admission. `emit` runs on the event loop, from the engine's
    dispatch, once per output in order (no task switch per token), and once with `EngineDead` if the engine
    fails. With `at_finish` the engine thread holds the outputs until the request finishes, then they are
    emitted together (callers that only need the end result cost no wake-up per step)."""
    emit: Emit
    at_finish: bool = False

    @staticmethod
    def queue(queue: OutputQueue, at_finish: bool = False) -> OutputSink:
        """A sink that puts each output into `queue` (read it with `read_outputs`)."""
        return OutputSink(queue.put_nowait, at_finish)


async def read_outputs(queue: OutputQueue, abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """A queue sink's outputs until the request finishes (EngineDead is raised); a consumer that leaves before
    that calls `abort`, so nothing runs on unobserved."""
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, EngineDead):
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        if not finished:
            abort()


class EngineHandle(Protocol):
    """Everything a node may ask of an engine. Coroutines wait for the engine thread; plain methods queue
    the command (in order with every other command) and return at once."""

    config: ModelConfig                 # immutable facts about the engine's model, published once
    tokenizer: Tokenizer | None
    max_model_len: int
    block_size: int
    kv_bytes_per_token: int
    # Multiply-adds per token of computing layer 0's K/V locally (0: this engine cannot), and doing so for a
    # reserved request's uncached tokens instead of receiving them (shared/kv/transfer.py `EDGE_LAYERS`).
    layer0_macs_per_token: int

    @property
    def alive(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    # ---- ordinary requests ----------------------------------------------------------------------
    async def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        """Admit the request, its outputs going to `sink`. Raises RequestError (nothing admitted) if the
        engine refuses it; cancelled while queued, the request is aborted after it is added."""

    async def submit_if_uncached_below(self, request: EngineRequest, sink: OutputSink, limit: int
                                       ) -> tuple[int, bool]:
        """Measure the prompt's cached prefix and, when fewer than `limit` tokens are left to compute, admit
        the request right there (one engine turn, not two): (cached tokens, whether it was admitted)."""

    def generate(self, request: EngineRequest, *, at_finish: bool = False) -> AsyncIterator[RequestOutput]:
        """`submit` with a queue sink, as an async iterator; a consumer that leaves early aborts the request."""

    def abort(self, request_id: str) -> None: ...

    async def cached_prefix(self, prompt_ids: list[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of the prompt the prefix cache holds under `cache_salt` (whole blocks)."""

    # ---- KV from outside ------------------------------------------------------------------------
    async def reserve(self, request: EngineRequest, sink: OutputSink | None) -> int:
        """Reserve blocks for a prompt whose KV is written from outside (`request.prompt` as token ids); returns
        its locally cached leading tokens. `sink` gets its outputs once activated (None: it never is, a
        prefetch). Raises NoFreeBlocks when the cache is full."""

    def write_kv(self, request_id: str, piece: KVSlice) -> None: ...

    async def write_first_layer_kv(self, request_id: str) -> None: ...

    async def activate(self, request_id: str, first: FirstToken) -> None: ...

    async def push_token(self, request_id: str, token: FirstToken) -> bool: ...

    async def take_over(self, request_id: str, kv_until: int) -> None: ...

    # ---- KV handed out --------------------------------------------------------------------------
    async def read_kv(self, request_id: str, start: int, end: int) -> list[KVSlice]: ...

    def release(self, request_id: str) -> None: ...

    def add_direct_route(self, stream_id: str, route: DirectRoute) -> None: ...

    def drop_direct_route(self, stream_id: str) -> None: ...

    # ---- resident prefixes ----------------------------------------------------------------------
    async def pin_prefix(self, request_id: str) -> list[int]: ...

    async def commit_prefix(self, request_id: str) -> list[int]: ...

    async def unpin(self, block_ids: list[int]) -> None: ...

    # ---- a parallel core's ranks ----------------------------------------------------------------
    async def rank_stats(self) -> list[dict]: ...

    async def shutdown_ranks(self) -> None: ...
