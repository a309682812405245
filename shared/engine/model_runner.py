"""Turns a scheduled batch into tensors, runs the model and samples.

Life cycle per step: `prepare(batch)` orders the batch (decode rows first,
then prefill chunks), builds token ids, positions, the slot of every new
token and the attention metadata; `run(batch)` executes the model under
`torch.inference_mode`, computes logits only for the rows that reach the end
of their known tokens, and samples them. The scheduler never sees a tensor;
this is the only place where sequences meet tensors.
"""

from __future__ import annotations

from typing import Callable

import torch

from edgecore.shared.engine import prompt_logprobs
from edgecore.shared.engine.sampler import SampleResult, sample
from edgecore.shared.engine.scheduler import ScheduledBatch
from edgecore.shared.engine.sequence import Sequence
from edgecore.shared.env import cpu_pack_enabled
from edgecore.shared.kv.pool import KVPool
from edgecore.shared.malloc import retain_freed_memory
from edgecore.shared.models.attention import AttentionMetadata, PrefillChunk
from edgecore.shared.models.layers import pack_for_cpu


def sampling_rows(ordered) -> tuple[list[int], list[Sequence]]:
    """Rows of the flattened batch whose sequence reaches its last known token (they sample), and those
    sequences."""
    rows, samplers, end = [], [], 0
    for seq, n in ordered:
        end += n
        if seq.num_computed_tokens + n == seq.num_tokens:
            rows.append(end - 1)
            samplers.append(seq)
    return rows, samplers


class ModelRunner:
    def __init__(self, model, pool: KVPool, sliding_window: int | None = None):
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.block_size = pool.block_size
        self.window = sliding_window
        if self.device == "cpu":
            retain_freed_memory()      # activations reuse heap pages instead of faulting in new ones
            if cpu_pack_enabled():
                pack_for_cpu(model)    # weights are final from here on

    def prepare(self, items: list[tuple[Sequence, int]], on_layer: Callable[[int], None] | None = None):
        bs = self.block_size
        decode = [(s, n) for s, n in items if n == 1]
        prefill = [(s, n) for s, n in items if n > 1]
        ordered = decode + prefill
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, n in ordered:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            blocks = seq.table.blocks
            for p in range(start, start + n):
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 kv_caches=self.pool.layers, on_layer=on_layer)
        if decode:
            ctx = [s.num_computed_tokens + 1 for s, _ in decode]
            longest = max(ctx)
            width = -(-longest // bs)
            table = torch.tensor([s.table.blocks[:width] + [0] * (width - len(s.table.blocks[:width]))
                                  for s, _ in decode], dtype=torch.long, device=dev)
            meta.num_decode = len(decode)
            meta.decode_blocks = table
            meta.block_size = bs
            meta.decode_len = longest
            if self.window is not None or min(ctx) < longest:     # else every row attends to all `longest`
                pos = torch.arange(longest, device=dev)
                ctx_t = torch.tensor(ctx, device=dev).unsqueeze(1)
                mask = pos.unsqueeze(0) < ctx_t
                if self.window is not None:
                    mask &= pos.unsqueeze(0) >= ctx_t - self.window
                meta.decode_mask = mask[:, None, None, :]
        offset = len(decode)
        for seq, n in prefill:
            start = seq.num_computed_tokens
            ctx = start + n
            chunk_slots, mask = None, None
            if start > 0:
                chunk_slots = self.pool.slots(seq.table.blocks, 0, ctx)
            if start > 0 or (self.window is not None and ctx > self.window):
                q_pos = torch.arange(start, ctx, device=dev).unsqueeze(1)
                k_pos = torch.arange(0, ctx, device=dev).unsqueeze(0)
                mask = k_pos <= q_pos
                if self.window is not None:
                    mask &= k_pos > q_pos - self.window
                if chunk_slots is None:
                    chunk_slots = self.pool.slots(seq.table.blocks, 0, ctx)
            meta.prefills.append(PrefillChunk(offset, n, ctx, chunk_slots, mask))
            offset += n
        return ordered, torch.tensor(ids, dtype=torch.long, device=dev), \
            torch.tensor(positions, dtype=torch.long, device=dev), meta

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, on_layer: Callable[[int, list], None] | None = None
            ) -> tuple[list[Sequence], SampleResult | None]:
        """Compute the batch; return the sequences that sampled and their samples. `on_layer(layer, items)`
        runs after each layer has written its K/V."""
        hook = (lambda layer: on_layer(layer, batch.items)) if on_layer is not None else None
        ordered, ids, positions, meta = self.prepare(batch.items, hook)
        hidden = self.model(ids, positions, meta)
        if prompt_logprobs.wanted(ordered):
            prompt_logprobs.record(self.model, hidden, ordered)
        rows, samplers = sampling_rows(ordered)
        if not samplers:
            return [], None
        logits = self.model.compute_logits(hidden[rows])
        return samplers, sample(logits, samplers)
