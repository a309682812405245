"""Speculative decoding by prompt lookup: n-gram drafts, verified in one step of the model.

Life cycle: an engine whose `EngineConfig.speculative` is set holds one `Speculator`; each step it
1. `propose`s, before scheduling: a running sequence in decode (its last token not yet computed) whose sampling
   allows drafting (no logprobs, penalties, biases or grammar) and whose drafting is on gets up to k tokens: those
   that followed the latest earlier occurrence of its last n tokens (n from `prompt_lookup_max` down to
   `prompt_lookup_min`; prompt and output alike). They are appended to its token ids and kept in `seq.draft`, so
   the scheduler gives the sequence 1 + k tokens, a chunk that computes the last token and the drafts' KV;
2. `fit`s the drafts to the step, after scheduling: a sequence left out of it (or preempted) loses its draft, one
   given fewer tokens keeps what the step computes;
3. the runner returns the logits of each drafted sequence's 1 + k rows and `verify` (tensors) accepts drafts left
   to right while each equals the token plain decoding draws at its position (the argmax; or the sampler's
   draw, seeded by position): the rejection rule for a draft that is one token, so every token is distributed
   as the model's p, and greedy and seeded requests emit exactly what plain decoding would;
4. `settle`s, before the scheduler counts the step: the drafts leave the token ids and the step counts one
   computed token for the sequence, as a plain decode. The engine pushes the accepted tokens and the next one
   through the output rules one by one (a stop ends the run), then `commit` counts the accepted drafts' KV as
   computed and enters the blocks they filled into the prefix cache. A rejected draft's KV stays in its slot until
   that position is computed again; it is never cached (only computed positions' blocks are).

Drafting switches itself off for a sequence whose drafts do not pay: every `PROBE_TOKENS` drafted tokens, its
tokens per verification step (1 + accepted drafts per step) are compared with what a step with drafts costs
against one without, measured on this engine's own steps of as many sequences (`observe`; a step of 5 tokens
cost 1.9x a decode step at batch 1 on the bundled model on CPU); until both kinds were measured, an acceptance
rate under `min_acceptance` decides. A sequence that does not pay stops for `PAUSE_TOKENS` output tokens, twice
as long after each further probe that does not pay, then tries again; while most recent judgments (all
sequences) say drafting does not pay, a new sequence starts paused, so a workload that does not repeat itself
costs one probe now and then rather than one per request. Drafts never make the scheduler preempt: they get what the step leaves of its budget and free blocks
(`Scheduler._drafts`); a draft model, which writes its KV before scheduling, takes free blocks beyond a reserve
for the step's decodes and prefills. No tensors here except in `verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from edgecore.shared.engine.sampler import draw_rows
from edgecore.shared.engine.scheduler import ScheduledBatch, Scheduler
from edgecore.shared.engine.sequence import Sequence, Status
from edgecore.shared.kv.block_manager import BlockManager
from edgecore.shared.models.config import SpeculativeConfig

if TYPE_CHECKING:
    from edgecore.shared.engine.draft_model import DraftModel

PROBE_TOKENS = 16       # drafted tokens before a sequence's acceptance rate is judged
PAUSE_TOKENS = 64       # output tokens a sequence then decodes without drafts before it tries again (doubling)


@dataclass
class DraftStats:
    """One sequence's drafting since it was last judged, and the output length before which it does not draft."""
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    draft_kv: int = 0       # a draft model's: positions whose draft KV matches the sequence's tokens
    paused_until: int = 0
    misses: int = 0         # probes in a row that did not pay


def lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of `tokens`, for the
    longest n in [n_min, n_max] that occurs."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)   # ends before the last token
        hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class Speculator:
    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int,
                 drafter: DraftModel | None = None, budget: int = 2048):
        """`budget`: the engine's tokens per step."""
        self.config = config
        self.budget = budget
        self.drafter = drafter      # None: prompt lookup
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.drafts = 0              # counters, exported as metrics (EngineStats)
        self.draft_tokens = 0
        self.accepted_tokens = 0
        # id(sequence) → its draft's length and its token count without it, from `settle` to `commit`
        self._settled: dict[int, tuple[int, int]] = {}
        # (sequences in the step, rounded up to a power of 2; with drafts) → mean seconds of such steps (EMA)
        self.step_seconds: dict[tuple[int, bool], float] = {}
        self.bucket = 1         # the latest step's sequence count, as in `step_seconds`
        self.paying = 1.0       # recent judgments that drafting paid (moving average over all sequences)

    @staticmethod
    def allows(seq: Sequence) -> bool:
        p = seq.params
        return (not seq.prefill_only and seq.grammar is None and p.logprobs is None and not p.adjusts_logits
                and p.prompt_logprobs is None)

    def stats(self) -> dict[str, Any]:
        """The counters, as `EngineStats` fields."""
        return {"speculative": True, "spec_drafts": self.drafts, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens}

    def schedule(self, scheduler: Scheduler) -> ScheduledBatch:
        """The scheduler's next step, with drafts proposed before it and fitted to it."""
        self.propose(scheduler.running)
        batch = scheduler.schedule()
        self.fit(batch.items, batch.preempted, scheduler.running)
        return batch

    def propose(self, running: list[Sequence]) -> None:
        """Append a draft to each running decode sequence that may draft and has one."""
        cfg = self.config
        # the draft model writes its KV before the scheduler runs: it takes only free blocks beyond what the running
        # sequences could need this step (a decode's token, a prefill's chunk), so the scheduler never preempts
        spare = len(self.bm.free) - sum(self.bm.blocks_needed(s.table, min(s.num_tokens, s.num_computed_tokens +
                                                                             self.budget)) for s in running)
        wanted: list[tuple[Sequence, int]] = []     # for the draft model: sequences and their k
        for seq in running:
            if seq.status is not Status.RUNNING or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            stats = self._stats(seq)
            if stats is None or seq.num_output_tokens < stats.paused_until:
                continue
            k = min(cfg.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)
            if k <= 0:
                continue
            if self.drafter is not None:     # its KV needs the blocks before it drafts: grow now
                need = self.bm.blocks_needed(seq.table, seq.num_tokens + k)
                if need > spare:
                    continue
                spare -= need
                self.bm.grow(seq.table, seq.num_tokens + k)
                wanted.append((seq, k))
                continue
            draft = lookup(np.asarray(seq.token_ids), k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
            if draft:               # (the scheduler gives it the step's leftover budget and free blocks, or cuts it)
                self._append(seq, draft)
        if wanted:
            seqs = [seq for seq, _ in wanted]
            kv = [cast(DraftStats, seq.draft_stats).draft_kv for seq in seqs]
            assert self.drafter is not None
            drafts, kv = self.drafter.propose(seqs, [k for _, k in wanted], kv)
            for seq, draft, valid in zip(seqs, drafts, kv):
                cast(DraftStats, seq.draft_stats).draft_kv = valid
                self._append(seq, draft)

    def _stats(self, seq: Sequence) -> DraftStats | None:
        """The sequence's drafting record, made at its first use; None: it may not draft."""
        if seq.draft_stats is None and self.allows(seq):
            seq.draft_stats = DraftStats()
            if self.paying < 0.5:       # drafting has not paid lately: start paused, probe later
                seq.draft_stats.paused_until = seq.num_output_tokens + PAUSE_TOKENS
        return seq.draft_stats

    def warm(self, seq: Sequence) -> None:
        """A sequence whose KV is still arriving from a core: the draft model computes its own KV of the prompt
        meanwhile, at most `CATCH_UP_PER_STEP` tokens a call (a reservation, then each KV piece written)."""
        stats = self._stats(seq) if self.drafter is not None else None
        if stats is not None and self.drafter is not None:
            stats.draft_kv = self.drafter.catch_up(seq, stats.draft_kv)

    @staticmethod
    def _append(seq: Sequence, draft: list[int]) -> None:
        seq.draft = draft
        seq.token_ids.extend(draft)

    @staticmethod
    def _drop(seq: Sequence, keep: int) -> None:
        base = len(seq.token_ids) - len(seq.draft)
        del seq.token_ids[base + keep:]
        seq.draft = seq.draft[:keep]
        if seq.draft_stats is not None:     # the draft model's KV of dropped drafts no longer matches the tokens
            seq.draft_stats.draft_kv = min(seq.draft_stats.draft_kv, base + keep)

    def fit(self, batch_items: list[tuple[Sequence, int]], preempted: list[Sequence], running: list[Sequence]
            ) -> None:
        """Cut each draft to what this step computes of it."""
        given = {id(seq): n for seq, n in batch_items}
        for seq in (*running, *preempted):
            if seq.draft:
                self._drop(seq, max(0, given.get(id(seq), 0) - 1) if seq.status is Status.RUNNING else 0)
        for seq in preempted:           # its blocks are gone, the draft model's KV with them
            if seq.draft_stats is not None:
                seq.draft_stats.draft_kv = 0

    def settle(self, batch_items: list[tuple[Sequence, int]]) -> None:
        """Take the drafts back off the token ids; the step counts one computed token for each drafted sequence
        (its accepted drafts are counted by `commit`)."""
        for j, (seq, _) in enumerate(batch_items):
            if seq.draft:
                self.drafts += 1
                self.draft_tokens += len(seq.draft)
                self._settled[id(seq)] = (len(seq.draft), len(seq.token_ids) - len(seq.draft))
                del seq.token_ids[len(seq.token_ids) - len(seq.draft):]
                seq.draft = []
                batch_items[j] = (seq, 1)

    def commit(self, seq: Sequence, accepted: int, finished: bool) -> None:
        """`accepted` of the sequence's drafts were pushed (then its own token, unless a stop came first): their KV
        counts as computed and their full blocks are cached (before a `finished` sequence frees them); judge the
        sequence's drafting."""
        drafted, base = self._settled.pop(id(seq), (accepted, seq.num_tokens))
        self.accepted_tokens += accepted
        seq.num_computed_tokens += accepted
        if finished:        # as plain decoding would have it: every token's KV but the last one's
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        self.bm.register_full_blocks(seq.table, seq.token_ids, seq.num_computed_tokens)
        stats = seq.draft_stats
        if stats is None:
            return
        stats.drafted += drafted
        stats.accepted += accepted
        stats.steps += 1
        stats.draft_kv = min(stats.draft_kv, base + accepted)     # the draft model's KV of accepted drafts only
        if stats.drafted >= PROBE_TOKENS:
            paid = self.pays(stats)
            self.paying = 0.8 * self.paying + 0.2 * paid
            if paid:
                stats.misses = 0
            else:
                stats.paused_until = seq.num_output_tokens + (PAUSE_TOKENS << min(stats.misses, 10))
                stats.misses += 1
            stats.drafted = stats.accepted = stats.steps = 0

    def observe(self, batch_items: list[tuple[Sequence, int]], seconds: float) -> None:
        """The model runner took `seconds` over this step (before `settle`): a step of decodes only, some with
        drafts or none, is a measurement; one with prompt chunks is not."""
        if not batch_items or any(n != 1 + len(seq.draft) for seq, n in batch_items):
            return
        key = (1 << (len(batch_items) - 1).bit_length(), any(seq.draft for seq, _ in batch_items))
        old = self.step_seconds.get(key)
        self.step_seconds[key] = seconds if old is None else 0.9 * old + 0.1 * seconds
        self.bucket = key[0]

    def pays(self, stats: DraftStats) -> bool:
        """Whether a sequence's recent drafting gave more tokens per step than steps with drafts cost."""
        plain, drafted = (self.step_seconds.get((self.bucket, d)) for d in (False, True))
        if plain is None or drafted is None:
            return stats.accepted >= self.config.min_acceptance * stats.drafted
        return (stats.steps + stats.accepted) / stats.steps >= drafted / plain


def verify(logits: torch.Tensor, draft: list[int], seq: Sequence) -> list[int]:
    """The tokens a drafted sequence emits this step: the accepted drafts, then one token of the model's own.
    `logits`: the rows of the sequence's last known token and its drafts ([1 + len(draft), vocab]).

    Each row draws the token plain decoding would draw at its position (greedy: the argmax; sampled: the
    sampler's exponential race, a seeded request's noise from its position's generator); drafts are accepted
    while they equal those tokens, and the first token that differs (or the one after the last draft) follows.
    For a draft that is a single token (a point mass q), this is the rejection rule: d is accepted with
    probability p(d), and otherwise the token drawn is distributed as p without d, renormalized. Each emitted
    token is distributed as the model's p, and a seeded request emits exactly what plain decoding would."""
    if seq.params.greedy:
        drawn = logits.argmax(-1).tolist()
    else:
        base = seq.num_output_tokens - len(draft)      # output position of the first row's token
        drawn = draw_rows(logits, seq.params, base).tolist()
    m = 0
    while m < len(draft) and draft[m] == drawn[m]:
        m += 1
    return draft[:m] + [drawn[m]]
