"""A step's work as a flat int64 tensor, broadcast from the driver rank to the others (no pickle).

Layout: [kind, count, ...]. STEP: for each scheduled item
`num_computed, n, num_tokens, num_blocks, token ids (n), block ids`; READ_KV:
`start, end, num_blocks, block ids`; STATS and STOP: nothing. `decode_plan` rebuilds light
sequence stand-ins that `ModelRunner.prepare` accepts, so every rank derives
identical slots and masks from the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STEP, READ_KV, STOP, STATS = 1, 2, 3, 4


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)


class PlanItem:
    """What `ModelRunner.prepare` reads from a sequence: progress, the step's tokens, its blocks."""

    def __init__(self, num_computed: int, n: int, num_tokens: int, ids: list[int], blocks: list[int]):
        self.num_computed_tokens = num_computed
        self.num_tokens = num_tokens
        self.token_ids = _Window(num_computed, ids)
        self.table = _Table(blocks)


class _Window:
    """token_ids[start:start+n] without materializing the earlier tokens."""

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, item: slice) -> list[int]:
        return self.ids[item.start - self.start: item.stop - self.start]


def encode_step(items) -> torch.Tensor:
    out = [STEP, len(items)]
    for seq, n in items:
        start = seq.num_computed_tokens
        out += [start, n, seq.num_tokens, len(seq.table.blocks)]
        out += seq.token_ids[start:start + n]
        out += seq.table.blocks
    return torch.tensor(out, dtype=torch.long)


def encode_read_kv(blocks: list[int], start: int, end: int) -> torch.Tensor:
    return torch.tensor([READ_KV, 1, start, end, len(blocks), *blocks], dtype=torch.long)


def encode_stop() -> torch.Tensor:
    return torch.tensor([STOP, 0], dtype=torch.long)


def encode_stats() -> torch.Tensor:
    return torch.tensor([STATS, 0], dtype=torch.long)


def decode_plan(plan: torch.Tensor):
    values = plan.tolist()
    kind, count = values[0], values[1]
    pos = 2
    if kind == STEP:
        items = []
        for _ in range(count):
            start, n, total, nblocks = values[pos:pos + 4]
            pos += 4
            ids = values[pos:pos + n]
            pos += n
            blocks = values[pos:pos + nblocks]
            pos += nblocks
            items.append((PlanItem(start, n, total, ids, blocks), n))
        return kind, items
    if kind == READ_KV:
        start, end, nblocks = values[pos:pos + 3]
        return kind, (values[pos + 3:pos + 3 + nblocks], start, end)
    return kind, None
