"""Continuous-batching scheduler: decides, each step, which sequences compute how many tokens.

Bookkeeping only (no tensors). Life cycle of a step:
1. `schedule()` walks the running sequences first (oldest first): each gets
   the tokens it still needs (1 when decoding, the next prefill chunk
   otherwise) within the per-step token budget, and the blocks to hold them.
   When the pool is exhausted the newest running sequence is preempted: its
   blocks are freed and it goes back to the front of the queue to be
   recomputed later (its full blocks usually survive in the prefix cache).
2. Then, if nothing was preempted, waiting sequences are admitted (FCFS) with
   their cached prefix and a first chunk, while budget, sequence slots and
   blocks allow.
3. After the model ran, `complete(scheduled)` advances each sequence's
   computed count and registers newly filled blocks in the prefix cache.
Finishing and aborting free a sequence's blocks through `finish()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from edgecore.shared.config import EngineConfig
from edgecore.shared.engine.sequence import Sequence, Status
from edgecore.shared.kv.block_manager import BlockManager, NoFreeBlocks


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, config: EngineConfig):
        self.bm = block_manager
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue `seq` behind every waiting sequence of its priority or better (lower value)."""
        seq.status = Status.WAITING
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        for i, other in enumerate(self.waiting):
            if other.priority > seq.priority:
                self.waiting.insert(i, seq)
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n, batch):
                break  # `seq` itself was preempted; everything after it too
            batch.items.append((seq, n))
            budget -= n
            i += 1
        if batch.preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            try:
                cached = self.bm.allocate_prompt(seq.table, seq.token_ids, budget,
                                                 use_cache=seq.params.prompt_logprobs is None)
            except NoFreeBlocks:
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            n = min(seq.num_tokens - cached, budget)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        while True:
            try:
                self.bm.grow(seq.table, num_tokens)
                return True
            except NoFreeBlocks:
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_table(seq.table)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def complete(self, batch: ScheduledBatch) -> None:
        for seq, n in batch.items:
            seq.num_computed_tokens += n
            self.bm.register_full_blocks(seq.table, seq.token_ids, seq.num_computed_tokens)

    def finish(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> None:
        """Take `seq` out of scheduling; free its blocks unless a reader still needs them."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.finish_reason = reason
        if keep_blocks:
            seq.status = Status.PREFILLED
        else:
            seq.status = Status.FINISHED
            self.bm.free_table(seq.table)
