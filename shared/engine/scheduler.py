"""Continuous-batching scheduler: decides, each step, which sequences compute how many tokens.

Bookkeeping only (no tensors). Sequences belong to request groups (`Sequence.group`,
declared at admission: the choices of one HTTP request are one group), and a step's token budget is
shared fairly between groups so one big request cannot starve small ones.
Life cycle of a step:
1. `schedule()` computes each group's share of the per-step token budget
   (the budget divided among the groups of the most urgent priority present).
   Running sequences come first (oldest first): a decoding one gets its 1
   token, a prefilling one its next chunk within its group's share, and the
   blocks to hold them. When the pool is exhausted a sequence of the group
   holding the most running sequences (its newest) is preempted: its blocks
   are freed and it goes back to the front of the queue to be recomputed
   later (its full blocks usually survive in the prefix cache).
2. Then, if nothing was preempted, waiting sequences are admitted with their
   cached prefix and a first chunk: by priority, then round-robin over groups
   (the group with the fewest running sequences first, ties in queue order),
   each within its group's share, while budget, sequence slots and blocks
   allow. A group whose share is spent waits for the next step.
3. Budget left over (shares unused by small groups) goes to the prefills that
   still have tokens, oldest first, so the step is never emptier than needed.
4. After the model ran, `complete(scheduled)` advances each sequence's
   computed count and registers newly filled blocks in the prefix cache.
Finishing and aborting free a sequence's blocks through `finish()`.
"""

from __future__ import annotations

from collections import Counter, deque
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
        share = self._share(budget)
        used: Counter[str] = Counter()           # tokens each group got this step
        waiting_for_share: list[Sequence] = []   # prefills whose group's share was spent
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            group = seq.group
            need = seq.num_tokens - seq.num_computed_tokens
            n = min(need, budget) if need <= 1 else min(need, budget, share - used[group])
            if n <= 0:
                waiting_for_share.append(seq)
                i += 1
                continue
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n, batch, i):
                continue         # `seq` itself was preempted: index i now holds the next one
            batch.items.append((seq, n))
            budget -= n
            used[group] += n
            i += 1
        if batch.preempted:
            return batch
        budget = self._admit(batch, budget, share, used)
        self._fill(batch, budget, waiting_for_share)
        return batch

    def _share(self, budget: int) -> int:
        """Tokens per request group this step: the budget over the groups of the most urgent priority."""
        seqs = [*self.running, *self.waiting]
        if not seqs:
            return budget
        urgent = min(s.priority for s in seqs)
        groups = {s.group for s in seqs if s.priority == urgent}
        return max(1, budget // len(groups))

    def _admit(self, batch: ScheduledBatch, budget: int, share: int, used: Counter) -> int:
        """Admit waiting sequences by priority, then the group with the fewest running ones. Returns the budget left."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return budget
        running = Counter(s.group for s in self.running)
        queues: dict[tuple[int, str], deque[tuple[int, Sequence]]] = {}
        for pos, seq in enumerate(self.waiting):
            queues.setdefault((seq.priority, seq.group), deque()).append((pos, seq))
        admitted: set[int] = set()
        while queues and budget > 0 and len(self.running) < self.config.max_num_seqs:
            key = min(queues, key=lambda k: (k[0], running[k[1]], queues[k][0][0]))
            group = key[1]
            room = min(budget, share - used[group])
            if room <= 0:
                del queues[key]          # this group's share is spent: it waits for the next step
                continue
            seq = queues[key][0][1]
            try:
                cached = self.bm.allocate_prompt(seq.table, seq.token_ids, room,
                                                 use_cache=seq.params.prompt_logprobs is None)
            except NoFreeBlocks:
                break
            queues[key].popleft()
            if not queues[key]:
                del queues[key]
            admitted.add(id(seq))
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            n = min(seq.num_tokens - cached, room)
            seq.status = Status.RUNNING
            self.running.append(seq)
            running[group] += 1
            batch.items.append((seq, n))
            budget -= n
            used[group] += n
        if admitted:
            self.waiting = deque(s for s in self.waiting if id(s) not in admitted)
        return budget

    def _fill(self, batch: ScheduledBatch, budget: int, waiting_for_share: list[Sequence]) -> None:
        """Give budget the shares left unused to prefills that still have tokens (no preemption for it)."""
        candidates = [(k, seq) for k, (seq, _) in enumerate(batch.items)] + [(None, s) for s in waiting_for_share]
        for k, seq in candidates:
            if budget <= 0:
                return
            have = batch.items[k][1] if k is not None else 0
            extra = min(seq.num_tokens - seq.num_computed_tokens - have, budget)
            if extra <= 0:
                continue
            try:
                self.bm.grow(seq.table, seq.num_computed_tokens + have + extra)
            except NoFreeBlocks:
                return
            if k is None:
                batch.items.append((seq, extra))
            else:
                batch.items[k] = (seq, have + extra)
            budget -= extra

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, index: int) -> bool:
        """Blocks for `seq` (at `index` in running), preempting not-yet-scheduled sequences (index ≥ `index`)
        of the group that holds the most running ones. False when `seq` itself was preempted."""
        while True:
            try:
                self.bm.grow(seq.table, num_tokens)
                return True
            except NoFreeBlocks:
                held = Counter(s.group for s in self.running)
                at = max(range(index, len(self.running)), key=lambda j: (held[self.running[j].group], j))
                victim = self.running.pop(at)
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

    def finish(self, seq: Sequence, reason: str | None, keep_blocks: bool = False) -> None:
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
