"""Continuous-batching scheduler: decides, each step, which sequences compute how many tokens.

Bookkeeping only (no tensors). Sequences belong to tenants (`Sequence.tenant`, with a `weight`; "" for a
node without tenants) and, inside a tenant, to request groups (`Sequence.group`, declared at admission: the
choices of one HTTP request are one group). A step's token budget and the sequence slots are shared in two
levels, so one tenant cannot starve another and one big request cannot starve small ones:
tenants by weight (weighted fair shares), then the groups of each tenant equally.
Life cycle of a step:
1. `schedule()` computes the shares of the per-step token budget among the
   sequences of the most urgent priority present (priority: lower first; a
   tenant's band and its request's own priority, shared/node/tenants.py): each
   tenant's share is budget × weight / the weights of the tenants present,
   split equally between that tenant's groups. Running sequences come first,
   most urgent priority first, then oldest first: a decoding one gets its 1
   token, a prefilling one of the urgent priority its next chunk within its
   group's share (a less urgent prefill waits for what is left, step 3), and
   the blocks to hold them. When the pool is exhausted a sequence is preempted:
   the least urgent, then of the tenant holding the most running sequences for
   its weight, then of the group holding the most (its newest): its blocks
   are freed and it goes back to the front of the queue to be recomputed
   later (its full blocks usually survive in the prefix cache).
2. Then, if nothing was preempted, waiting sequences are admitted with their
   cached prefix and a first chunk: by priority, then the tenant with the
   fewest running sequences for its weight (slots are shared by weight), then
   the group with the fewest running sequences, ties in queue order, each
   within its group's share, while budget, sequence slots and blocks allow.
   A group whose share is spent waits for the next step.
3. Budget left over goes first to the prefills of tenants that have not used
   their share (a tenant's unused group shares stay with the tenant), then to
   any prefill that still has tokens, oldest first, so the step is never
   emptier than needed.
4. After the model ran, `complete(scheduled)` advances each sequence's
   computed count and registers newly filled blocks in the prefix cache.
Finishing and aborting free a sequence's blocks through `finish()`.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from edgecore.shared.models.config import EngineConfig
from edgecore.shared.engine.sequence import Sequence, Status
from edgecore.shared.kv.block_manager import BlockManager, NoFreeBlocks


Key = tuple[str, str]          # (tenant, group): where a sequence's tokens are counted


def _key(seq: Sequence) -> Key:
    return seq.tenant, seq.group


@dataclass
class Shares:
    """One step's token shares: per (tenant, group) and per tenant among the most urgent priority's sequences;
    `default` for a group of a less urgent priority (what it may be admitted with)."""
    groups: dict[Key, int] = field(default_factory=dict)
    tenants: dict[str, int] = field(default_factory=dict)
    urgent: int = 0
    default: int = 0

    def of(self, seq: Sequence) -> int:
        return self.groups.get(_key(seq), self.default)


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

    def prefill_tokens_left(self) -> int:
        """Prompt tokens of running and waiting sequences not computed yet: the prefill queue."""
        return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in (*self.running, *self.waiting))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: s.priority)      # stable: most urgent first, then in admission order
        shares = self.shares(budget)
        used: Counter[Key] = Counter()           # tokens each (tenant, group) got this step
        waiting_for_share: list[Sequence] = []   # prefills whose group's share was spent (or less urgent ones)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            need = seq.num_tokens - seq.num_computed_tokens
            if need <= 1 + len(seq.draft):      # a decode (its draft, if any, gets leftover room: `_drafts`)
                n = min(need - len(seq.draft), budget)
            else:
                share = shares.of(seq) if seq.priority == shares.urgent else 0
                n = min(need, budget, share - used[_key(seq)])
            if n <= 0:
                waiting_for_share.append(seq)
                i += 1
                continue
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n, batch, i):
                continue         # `seq` itself was preempted: index i now holds the next one
            batch.items.append((seq, n))
            budget -= n
            used[_key(seq)] += n
            i += 1
        if batch.preempted:
            return batch
        budget = self._admit(batch, budget, shares, used)
        self._fill(batch, budget, waiting_for_share, shares, used)
        self._drafts(batch)
        return batch

    def _drafts(self, batch: ScheduledBatch) -> None:
        """Speculative drafts (speculative.py) get what the step leaves: its budget left after every decode,
        prefill and admission, and blocks the pool has free (never a preemption)."""
        budget = self.config.max_num_batched_tokens - batch.num_tokens
        for k, (seq, n) in enumerate(batch.items):
            if budget <= 0:
                return
            extra = min(len(seq.draft), budget) if n == 1 else 0
            if extra and self.bm.blocks_needed(seq.table, seq.num_computed_tokens + 1 + extra) <= len(self.bm.free):
                self.bm.grow(seq.table, seq.num_computed_tokens + 1 + extra)
                batch.items[k] = (seq, 1 + extra)
                budget -= extra

    def shares(self, budget: int) -> Shares:
        """This step's shares of `budget`: among the sequences of the most urgent priority, tenants by weight,
        then each tenant's groups equally."""
        seqs = [*self.running, *self.waiting]
        if not seqs:
            return Shares(default=budget)
        urgent = min(s.priority for s in seqs)
        groups: dict[str, set[str]] = {}
        weights: dict[str, float] = {}
        for s in seqs:
            if s.priority == urgent:
                groups.setdefault(s.tenant, set()).add(s.group)
                weights[s.tenant] = max(weights.get(s.tenant, 0.0), s.weight)
        total = sum(weights.values())
        out = Shares(urgent=urgent, default=max(1, budget // sum(len(g) for g in groups.values())))
        for tenant, names in groups.items():
            mine = budget * weights[tenant] / total
            out.tenants[tenant] = max(1, int(mine))
            for group in names:
                out.groups[(tenant, group)] = max(1, int(mine / len(names)))
        return out

    def _admit(self, batch: ScheduledBatch, budget: int, shares: Shares, used: Counter) -> int:
        """Admit waiting sequences by priority, then the tenant with the fewest running ones for its weight, then
        the group with the fewest. Returns the budget left."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return budget
        running = Counter(_key(s) for s in self.running)
        tenants = Counter(s.tenant for s in self.running)
        queues: dict[tuple[int, str, str], deque[tuple[int, Sequence]]] = {}
        for pos, seq in enumerate(self.waiting):
            queues.setdefault((seq.priority, *_key(seq)), deque()).append((pos, seq))
        admitted: set[int] = set()
        while queues and budget > 0 and len(self.running) < self.config.max_num_seqs:
            qkey = min(queues, key=lambda k: (k[0], tenants[k[1]] / queues[k][0][1].weight, running[k[1:]],
                                              queues[k][0][0]))
            seq = queues[qkey][0][1]
            key = _key(seq)
            room = min(budget, shares.of(seq) - used[key])
            if room <= 0:
                del queues[qkey]         # this group's share is spent: it waits for the next step
                continue
            try:
                cached = self.bm.allocate_prompt(seq.table, seq.token_ids, room,
                                                 use_cache=seq.params.prompt_logprobs is None)
            except NoFreeBlocks:
                break
            queues[qkey].popleft()
            if not queues[qkey]:
                del queues[qkey]
            admitted.add(id(seq))
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            n = min(seq.num_tokens - cached, room)
            seq.status = Status.RUNNING
            self.running.append(seq)
            running[key] += 1
            tenants[seq.tenant] += 1
            batch.items.append((seq, n))
            budget -= n
            used[key] += n
        if admitted:
            self.waiting = deque(s for s in self.waiting if id(s) not in admitted)
        return budget

    def _fill(self, batch: ScheduledBatch, budget: int, waiting_for_share: list[Sequence], shares: Shares,
              used: Counter) -> None:
        """Give the budget left to prefills that still have tokens (no preemption for it): first each tenant's
        unused share to its own prefills, then whatever is left to any, oldest first."""
        spent: Counter[str] = Counter()
        for (tenant, _), n in used.items():
            spent[tenant] += n
        room = {t: share - spent[t] for t, share in shares.tenants.items()}
        candidates: list[tuple[int | None, Sequence]] = [(k, seq) for k, (seq, _) in enumerate(batch.items)
                                                          if not seq.draft]     # (drafts: `_drafts`)
        candidates += [(None, s) for s in waiting_for_share]
        for own in (True, False):
            for c, (k, seq) in enumerate(candidates):
                if budget <= 0:
                    return
                limit = min(budget, room.get(seq.tenant, 0)) if own else budget
                extra, k = self._extend(batch, k, seq, limit)
                if extra < 0:
                    return
                candidates[c] = (k, seq)
                budget -= extra
                room[seq.tenant] = room.get(seq.tenant, 0) - extra

    def _extend(self, batch: ScheduledBatch, k: int | None, seq: Sequence, limit: int) -> tuple[int, int | None]:
        """Up to `limit` more tokens for `seq` (item `k` of the batch, None: not in it yet): (tokens given, -1
        when the pool is full; its item's index)."""
        have = batch.items[k][1] if k is not None else 0
        extra = min(seq.num_tokens - seq.num_computed_tokens - have, limit)
        if extra <= 0:
            return 0, k
        try:
            self.bm.grow(seq.table, seq.num_computed_tokens + have + extra)
        except NoFreeBlocks:
            return -1, k
        if k is None:
            batch.items.append((seq, extra))
            return extra, len(batch.items) - 1
        batch.items[k] = (seq, have + extra)
        return extra, k

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, index: int) -> bool:
        """Blocks for `seq` (at `index` in running), preempting not-yet-scheduled sequences (index ≥ `index`):
        the least urgent, of the tenant holding the most running ones for its weight, of the group holding the
        most, the newest. False when `seq` itself was preempted."""
        while True:
            try:
                self.bm.grow(seq.table, num_tokens)
                return True
            except NoFreeBlocks:
                at = self._victim(index)
                victim = self.running.pop(at)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    return False

    def _victim(self, index: int) -> int:
        """Of the running sequences from `index` on: the least urgent, of the tenant holding the most running
        sequences for its weight, of the group holding the most, the newest."""
        held = Counter(_key(s) for s in self.running)
        tenants = Counter(s.tenant for s in self.running)

        def load(j: int) -> tuple[int, float, int, int]:
            s = self.running[j]
            return s.priority, tenants[s.tenant] / s.weight, held[_key(s)], j
        return max(range(index, len(self.running)), key=load)

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
