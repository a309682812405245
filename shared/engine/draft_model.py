"""`DraftModel`: a small model of the same vocabulary that drafts tokens for speculative decoding.

Life cycle: an engine whose speculative config names a draft model (`--draft-model DIR`, or
`--speculative-config '{"method": "draft_model", "model": DIR}'`) loads it next to the target, with a KV pool
of its own with as many blocks as the target's, addressed by the target's block tables (one allocator, one set
of tables: the target's `BlockManager` grows a drafting sequence's table before the draft model writes, so no
block is ever the draft's alone). A request whose KV comes from a core (`reserve`, then KV pieces written) has
its prompt's draft KV computed meanwhile by `catch_up` (bounded per call), so no draft KV crosses a link and
little is left to do when it starts decoding. Each step the `Speculator` hands it the sequences that draft;
`propose` brings each one's draft KV up to its last known token (a chunk from where the draft model stopped,
within a per-step allowance), then runs
k - 1 more single-token steps, all sequences batched, and returns each one's k greedy drafts (a point mass each:
`speculative.verify` keeps the target's distribution) with how far its draft KV now goes. The `Speculator` keeps
that count per sequence (`DraftStats.draft_kv`): after verification, only the accepted positions stay valid (the
rest is overwritten when computed again); a preempted or new sequence starts from 0.

Limits (said at start-up): the target's vocabulary and the draft's must match; targets that release KV blocks
no layer attends to (every layer windowed) are refused, since the draft may still need those positions.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from edgecore.shared.engine.model_runner import ModelRunner, sampling_rows
from edgecore.shared.engine.sequence import Sequence
from edgecore.shared.engine.step_plan import PlanItem
from edgecore.shared.errors import ConfigError
from edgecore.shared.kv.pool import KVPool
from edgecore.shared.models.config import CacheConfig, ModelConfig
from edgecore.shared.models.loader import load_model

if TYPE_CHECKING:
    from edgecore.shared.models.llama import Attention

log = logging.getLogger("edgecore.draft_model")

CATCH_UP_PER_STEP = 512     # tokens of prompts the draft model catches up with per step, all sequences together


class DraftModel:
    def __init__(self, model_dir: str | Path, target: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                 device: str):
        config = ModelConfig.from_dir(model_dir)
        if config.vocab_size != target.vocab_size:
            raise ConfigError(f"draft model {model_dir}: vocabulary of {config.vocab_size} tokens, the target's is "
                              f"{target.vocab_size}; a draft model must share the target's tokenizer")
        if target.releases_kv:
            raise ConfigError("a draft model needs the target's KV blocks kept: this target releases the blocks "
                              "its windowed layers no longer attend to (use prompt lookup instead)")
        self.config = config
        self.model = load_model(model_dir, dtype, device, config=config)
        layers = self.model.model.layers
        heads = cast("Attention", layers[0].self_attn).num_kv_heads
        self.pool = KVPool(config, cache, dtype, device, num_kv_heads=heads, num_layers=len(layers))
        self.runner = ModelRunner(self.model, self.pool, config.sliding_window, False)
        log.info("draft model %s: %d layers, its KV pool %.1f MiB beside the target's (%d blocks; on CPU mapped as "
                 "used)", model_dir, len(layers), self.pool.block_bytes * cache.num_blocks / 2**20, cache.num_blocks)
        self.steps = 0                           # forward passes (a metric of what drafting costs)

    def propose(self, seqs: list[Sequence], ks: list[int], computed: list[int]) -> tuple[list[list[int]], list[int]]:
        """Up to `ks[i]` greedy drafts for each sequence (their tables already cover them), whose draft KV is
        valid for its first `computed[i]` positions; the drafts, and how many positions are valid after. A
        sequence further behind than the step's catch-up allowance (`CATCH_UP_PER_STEP`) only catches up."""
        tokens = [list(s.token_ids) for s in seqs]
        done = list(computed)
        drafts: list[list[int]] = [[] for _ in seqs]
        allowance = CATCH_UP_PER_STEP
        chunk = {}
        for i in range(len(seqs)):
            n = len(tokens[i]) - done[i]
            if n > 1:
                n = min(n, allowance)
                allowance -= n
            if n > 0:
                chunk[i] = n
        while chunk:
            picks = self._step([PlanItem(done[i], n, done[i] + n, tokens[i][done[i]:done[i] + n], seqs[i].table.blocks,
                                         str(i)) for i, n in chunk.items()])
            still = {}
            for i, n in chunk.items():
                done[i] += n
                if done[i] < len(tokens[i]):        # still behind: it drafts in a later step
                    continue
                drafts[i].append(picks[str(i)])
                tokens[i].append(drafts[i][-1])
                if len(drafts[i]) < ks[i]:
                    still[i] = 1
            chunk = still
        return drafts, done

    def catch_up(self, seq: Sequence, done: int) -> int:
        """The draft KV of up to `CATCH_UP_PER_STEP` more of the sequence's known tokens (its table covers
        them); how many positions are valid after."""
        n = min(seq.num_tokens - done, CATCH_UP_PER_STEP)
        if n <= 0:
            return done
        self._step([PlanItem(done, n, done + n, seq.token_ids[done:done + n], seq.table.blocks, seq.request_id)])
        return done + n

    @torch.inference_mode()
    def _step(self, items: list[PlanItem]) -> dict[str, int]:
        """One forward pass of the draft model; each item's greedy next token (items that reach their end)."""
        self.steps += 1
        ordered, ids, positions, meta = self.runner.prepare([(item, item.num_tokens - item.num_computed_tokens)
                                                             for item in items])
        flat = self.runner.flat
        hidden = (flat.forward(ids, positions, meta) if flat is not None and flat.takes(meta, ids.shape[0])
                  else self.model(ids, positions, meta))
        rows, samplers = sampling_rows(ordered)
        best = self.model.compute_logits(hidden[rows]).argmax(-1).tolist()
        return {s.request_id: t for s, t in zip(samplers, best)}
