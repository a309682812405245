"""The engine's side of the disk KV tier (shared/kv/tier.py): spills out of the pool, prefixes read back in.

Engine thread only. Life cycle of a request whose prefix the tier holds:
1. `begin(seq)` at admission (`LLMEngine.add_request`): the prompt's full blocks are looked up in the pool
   (the prefix cache), then the blocks after the pool's prefix in the tier's index (no I/O). When the tier
   holds the next ones, the pool's prefix blocks are pinned (so they survive until the request is admitted),
   a load goes to the tier's reader thread, and the request waits here, outside the scheduler, while the
   engine steps on with everything else.
2. `settle()` before each step: each finished load's blocks (the longest verified run) are written into pool
   blocks registered in the prefix cache under their hashes (`BlockManager.adopt`), pinned, and the request
   is queued in the scheduler, which admits it with them as its cached prefix (their prefill is skipped).
   A load that found nothing usable simply queues the request: it is recomputed, never wrong.
3. `release_admitted()` after each schedule: a queued request that was admitted (or ended) drops its pins.
4. `forget(request_id)` on abort: pins dropped; a request still loading ends here.
A reservation (KV from a core, `LLMEngine.reserve`) first has its prefix read the same way (`prefetch`, awaited
by `EngineThread.reserve`, not on the engine thread): the blocks are adopted and pinned without a sequence, the
reservation takes them as its cached prefix (the core sends none of their KV) and drops the pins; pins nobody
took are dropped after PREFETCH_HOLD_S.
Spill: the block manager calls `spill` when it evicts a cached block; its K/V is copied out of the pool (the
block is about to be overwritten) into host memory and queued for the tier's writer, or dropped if the writer
is behind.
`close()` (engine shutdown) writes every block still cached (bounded wait), so a restart finds them too.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from edgecore.shared.engine.sequence import Sequence, Status
from edgecore.shared.kv.block_manager import BlockManager, NoFreeBlocks, prefix_hashes
from edgecore.shared.kv.pool import KVPool
from edgecore.shared.kv.tier import BlockShape, KVTier
from edgecore.shared.kv.wire import DTYPE_NAMES, codec_rope

if TYPE_CHECKING:
    from edgecore.shared.models.config import CacheConfig, ModelConfig

log = logging.getLogger(__name__)

FLUSH_SECONDS = 5.0       # at shutdown, at most this long writing the blocks still cached
PREFETCH_HOLD_S = 30.0    # a prefetched prefix stays pinned this long at most, waiting for its reservation


def open_tier(cache: CacheConfig, config: ModelConfig, pool: KVPool, block_manager: BlockManager,
              fingerprint: str | None) -> TierLoads | None:
    """The engine's tier, when `cache.tier_dir` asks for one (and the prefix cache is on: the tier holds its
    blocks); None otherwise. A tier needs the model's fingerprint (its keys): an engine built without one
    (LLMEngine from a model object, a parallel core's ranks) runs without, with a warning."""
    if cache.tier_dir is None or not cache.enable_prefix_caching:
        return None
    if fingerprint is None:
        log.warning("KV tier %s: off (this engine was built without the model's fingerprint)", cache.tier_dir)
        return None
    tier = KVTier(cache.tier_dir, cache.tier_bytes, fingerprint, pool_shape(pool), cache.tier_codec,
                  codec_rope(config))
    return TierLoads(tier, block_manager, pool)


def pool_shape(pool: KVPool) -> BlockShape:
    """What one block of this pool looks like (on the wire and on disk)."""
    return BlockShape(len(pool.k), pool.block_size, pool.k[0].shape[1], pool.k[0].shape[2], pool.v[0].shape[2],
                      DTYPE_NAMES[pool.dtype])


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """A spilled block in host memory (pinned where CUDA is there): the writer's queue holds up to its size in
    blocks, which must not sit in accelerator memory outside the pool's KV budget."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(t)               # synchronous: the pool block is overwritten next
    return host


@dataclass
class _Load:
    seq: Sequence | None                # None: a prefetch for a reservation
    salt: str | None
    pooled: list[int]                   # the pool's prefix blocks (pinned)
    hashes: list[int]                   # the tier's blocks being read, after them
    future: Future[list[tuple[torch.Tensor, torch.Tensor]]]


class TierLoads:
    def __init__(self, tier: KVTier, block_manager: BlockManager, pool: KVPool):
        self.tier, self.bm, self.pool = tier, block_manager, pool
        self.bs = block_manager.block_size
        self.loads: dict[str, _Load] = {}
        self.pins: dict[str, tuple[Sequence | None, list[int], float]] = {}    # (..., when pinned)
        block_manager.on_evict = self.spill

    @property
    def loading(self) -> int:
        return len(self.loads)

    # ---- spill ----------------------------------------------------------------------------------------------
    def spill(self, block_id: int, block_hash: int, salt: str | None, wait: float = 0.0) -> None:
        """A cached block leaves the pool: copy its K/V out and queue it for the tier (if not there already)."""
        if wait <= 0 and not self.tier.accepting():
            self.tier.count_dropped()
            return
        key = self.tier.key(block_hash, salt)
        if self.tier.has(key):
            return
        lo, hi = block_id * self.bs, (block_id + 1) * self.bs
        k = _on_host(torch.stack([t[lo:hi] for t in self.pool.k]))     # [layers, tokens, heads, width], copies
        v = _on_host(torch.stack([t[lo:hi] for t in self.pool.v]))
        self.tier.spill(key, block_hash, k, v, wait)

    # ---- prefixes read back ---------------------------------------------------------------------------------
    def _tier_run(self, token_ids: list[int], salt: str | None) -> tuple[list[int], list[tuple[bytes, int]], int]:
        """(pool prefix block ids, (key, hash) of the tier's blocks right after them, blocks looked up after the
        pool's prefix)."""
        pooled = self.bm.match_prefix(token_ids, salt)
        rest = prefix_hashes(token_ids, self.bs, len(token_ids) - 1, salt)[len(pooled):]
        run = []
        for h in rest:
            key = self.tier.key(h, salt)
            if not self.tier.has(key):
                break
            run.append((key, h))
        return pooled, run, len(rest)

    def cached_tokens(self, token_ids: list[int], salt: str | None) -> int:
        """Tokens of the prompt's prefix held in the pool or, right after it, in the tier (no I/O)."""
        pooled, run, _ = self._tier_run(token_ids, salt)
        return (len(pooled) + len(run)) * self.bs

    def begin(self, seq: Sequence) -> bool:
        """Start reading the blocks after the pool's prefix from the tier; True when the request now waits here
        (False: the tier has none of them; queue it as usual)."""
        return self._start(seq.request_id, seq, seq.token_ids, seq.table.salt) is not None

    def prefetch(self, request_id: str, token_ids: list[int], salt: str | None
                 ) -> Future[list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """Start reading the blocks after the pool's prefix for a reservation to come; the future to await
        (None: the tier has none of them)."""
        return self._start(request_id, None, token_ids, salt)

    def _start(self, request_id: str, seq: Sequence | None, token_ids: list[int], salt: str | None
               ) -> Future[list[tuple[torch.Tensor, torch.Tensor]]] | None:
        pooled, run, looked_up = self._tier_run(token_ids, salt)
        if looked_up > len(run):
            self.tier.count_misses(looked_up - len(run))
        if not run or request_id in self.loads or request_id in self.pins:
            return None
        self.bm.pin(pooled)
        future = self.tier.load(run)
        self.loads[request_id] = _Load(seq, salt, pooled, [h for _, h in run], future)
        return future

    def settle(self) -> list[Sequence]:
        """The requests whose loads finished, their blocks now cached in the pool (pinned): to be queued."""
        ready = []
        for rid, load in list(self.loads.items()):
            if not load.future.done():
                continue
            del self.loads[rid]
            try:
                blocks = load.future.result()
            except Exception:        # the reader's own failure: recompute
                log.exception("KV tier: a load failed")
                blocks = []
            pins = list(load.pooled)
            for block_hash, (k, v) in zip(load.hashes, blocks):
                try:
                    bid, fresh = self.bm.adopt(block_hash, load.salt)
                except NoFreeBlocks:
                    break
                if fresh:
                    slots = torch.arange(bid * self.bs, (bid + 1) * self.bs, device=self.pool.device)
                    k, v = k.to(self.pool.device), v.to(self.pool.device)
                    for layer in range(len(self.pool.k)):
                        self.pool.write(layer, slots, k[layer], v[layer])
                pins.append(bid)
            self.pins[rid] = (load.seq, pins, time.monotonic())
            if load.seq is not None:
                ready.append(load.seq)
        return ready

    def wait(self, timeout: float) -> None:
        """Nothing else to run: wait up to `timeout` seconds for a load to finish."""
        if self.loads:
            wait([load.future for load in self.loads.values()], timeout, FIRST_COMPLETED)

    def release_admitted(self) -> None:
        """Pins of queued requests now admitted (or ended), and of prefetches nobody took in PREFETCH_HOLD_S."""
        expired = time.monotonic() - PREFETCH_HOLD_S
        for rid, (seq, pins, since) in list(self.pins.items()):
            done = seq.status is not Status.WAITING if seq is not None else since < expired
            if done:
                del self.pins[rid]
                self.bm.release_blocks(pins)

    def forget(self, request_id: str, prefetch_only: bool = False) -> bool:
        """An aborted request, or a reservation that took (or failed to take) its prefetched prefix: its pins
        dropped. True when it was still loading (it is in no queue). `prefetch_only`: a queued request's load
        or pins of that id stay (a reservation refused for reusing a live request's id)."""
        held = self.pins.get(request_id)
        if held is not None and not (prefetch_only and held[0] is not None):
            del self.pins[request_id]
            self.bm.release_blocks(held[1])
        load = self.loads.get(request_id)
        if load is None or (prefetch_only and load.seq is not None):
            return False
        del self.loads[request_id]
        load.future.cancel()
        self.bm.release_blocks(load.pooled)
        return True

    def stats(self) -> dict[str, Any]:
        """The tier's fields of the engine's stats snapshot (EngineStats `tier_*`)."""
        c = self.tier.counters
        return {"tier_hit_blocks": c.hit_blocks, "tier_miss_blocks": c.miss_blocks, "tier_read_bytes": c.read_bytes,
                "tier_read_seconds": c.read_seconds, "tier_written_blocks": c.written_blocks,
                "tier_written_bytes": c.written_bytes, "tier_dropped_blocks": c.dropped_blocks,
                "tier_errors": c.errors, "tier_removed_files": c.removed_bad, "tier_used_bytes": c.used_bytes,
                "tier_capacity_bytes": self.tier.capacity, "tier_files": c.files, "tier_healthy": c.healthy}

    def close(self) -> None:
        """Write every block still cached in the pool to the tier (within FLUSH_SECONDS), then close it."""
        deadline = time.monotonic() + FLUSH_SECONDS
        for block in self.bm.blocks:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if block.hash is not None and self.bm.cached.get(block.hash) == block.block_id:
                self.spill(block.block_id, block.hash, block.salt, wait=left)
        self.tier.close(timeout=max(0.1, deadline - time.monotonic()))
