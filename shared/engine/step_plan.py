"""A step's work as a flat int64 tensor, broadcast from the driver rank to the others (no pickle).

Layout: [kind, count, ...]. STEP: `routes_len, routes bytes (one byte per value)`, then for
each scheduled item `num_computed, n, num_tokens, num_blocks, token ids (n), block ids`. The
routes are a msgpack map, usually empty: `new` (KV streams the ranks should open: id → route),
`drop` (stream ids to forget) and `ids` (item index → stream id) for the items of streamed
requests, which `PlanItem.request_id` then carries on every rank; READ_KV:
`start, end, num_blocks, block ids`; STATS and STOP: nothing. `decode_plan` rebuilds light
sequence stand-ins that `ModelRunner.prepare` accepts, so every rank derives
identical slots and masks from the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from edgecore.shared.kv.transfer import DirectRoute

if TYPE_CHECKING:
    from edgecore.shared.engine.sequence import Sequence

STEP, READ_KV, STOP, STATS = 1, 2, 3, 4


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)


class PlanItem:
    """What `ModelRunner.prepare` reads from a sequence: progress, the step's tokens, its blocks."""

    def __init__(self, num_computed: int, n: int, num_tokens: int, ids: list[int], blocks: list[int],
                 request_id: str = ""):
        self.request_id = request_id
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


class StepRoutes(msgspec.Struct, omit_defaults=True):
    new: dict[str, DirectRoute] = {}   # stream id → route (encoded as [request_id, session, codec, skip, total])
    drop: list[str] = []
    ids: dict[int, str] = {}           # item index → stream id


def encode_step(items: list[tuple[Sequence, int]], routes: StepRoutes | None = None) -> torch.Tensor:
    blob = msgspec.msgpack.encode(routes) if routes is not None else b""
    out = [STEP, len(items), len(blob), *blob]
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


# A decoded plan's payload: STEP (items, routes), READ_KV (blocks, start, end), STATS and STOP None.
StepPayload = tuple[list[tuple[PlanItem, int]], StepRoutes]
ReadKVPayload = tuple[list[int], int, int]


def decode_plan(plan: torch.Tensor) -> tuple[int, StepPayload | ReadKVPayload | None]:
    values = plan.tolist()
    kind, count = values[0], values[1]
    pos = 2
    if kind == STEP:
        size = values[pos]
        routes = msgspec.msgpack.decode(bytes(values[pos + 1:pos + 1 + size]), type=StepRoutes) \
            if size else StepRoutes()
        pos += 1 + size
        items: list[tuple[PlanItem, int]] = []
        for index in range(count):
            start, n, total, nblocks = values[pos:pos + 4]
            pos += 4
            ids = values[pos:pos + n]
            pos += n
            blocks = values[pos:pos + nblocks]
            pos += nblocks
            items.append((PlanItem(start, n, total, ids, blocks, routes.ids.get(index, "")), n))
        return kind, (items, routes)
    if kind == READ_KV:
        start, end, nblocks = values[pos:pos + 3]
        return kind, (values[pos + 3:pos + 3 + nblocks], start, end)
    return kind, None
