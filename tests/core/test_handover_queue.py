"""A connection's outbox under decode handover: tokens go ahead of queued KV (in order among themselves), and a
handover request's KV is cut, by whoever queues it, into small frames that cover the slice exactly."""

import asyncio

import torch

from edgecore.core.outbox import Outbox, pieces
from edgecore.core.transfer import HandoverLimits, KVSend, Transfer
from edgecore.protocol import messages as m
from edgecore.shared.errors import ConfigError
from edgecore.shared.kv.transfer import KVSlice

import pytest


def kv(tokens, start=0, heads=2, dim=32):
    k = torch.arange(tokens * heads * dim, dtype=torch.float32).reshape(1, tokens, heads, dim)
    return KVSlice(3, start, start + tokens, 0, k, -k)


def test_urgent_items_overtake_queued_kv_in_their_own_order():
    async def scenario():
        q = Outbox()
        t = Transfer("i", "r", q, "lossless", 100)
        a, b = KVSend(t, kv(4)), KVSend(t, kv(4, 4))
        q.put(a)
        q.put(b)
        q.put(m.PrefillDone("r", 1), urgent=True)
        q.put(m.Token("r", 1, 2), urgent=True)
        got = [await q.get()]
        q.put(m.Token("r", 2, 3), urgent=True)    # after one urgent item was taken
        q.put(m.PrefillDone("x", 0))              # an ordinary message keeps its FIFO place
        while not q.empty():
            got.append(q.get_nowait())
        return got, a, b

    got, a, b = asyncio.run(scenario())
    assert got == [m.PrefillDone("r", 1), m.Token("r", 1, 2), m.Token("r", 2, 3), a, b, m.PrefillDone("x", 0)]


@pytest.mark.parametrize("tokens,start", [(700, 0), (129, 16), (3, 5)])
def test_pieces_cover_the_slice_exactly(tokens, start):
    t = Transfer("i", "r", None, "lossless", start + tokens, piece_bytes=8 * 1024)
    item = KVSend(t, kv(tokens, start))
    cut = pieces(item, t.piece_bytes)
    per_token = 2 * 2 * 32 * 4
    assert all((p.piece.token_end - p.piece.token_start) * per_token <= 8 * 1024 for p in cut)
    assert [p.piece.token_start for p in cut][0] == start and cut[-1].piece.token_end == start + tokens
    assert all(x.piece.token_end == y.piece.token_start for x, y in zip(cut, cut[1:]))
    assert torch.equal(torch.cat([p.piece.k for p in cut], 1), item.piece.k)
    assert torch.equal(torch.cat([p.piece.v for p in cut], 1), item.piece.v)


def test_only_handover_transfers_are_cut():
    async def scenario():
        q = Outbox()
        for t in (Transfer("i", "r", q, "lossless", 700), Transfer("j", "s", q, "lossless", 700, piece_bytes=64 * 1024)):
            q.extend(pieces(KVSend(t, kv(700)), t.piece_bytes))
        assert q.nbytes == 2 * 700 * 2 * 2 * 32 * 4
        got = [q.get_nowait().transfer.request_id for _ in range(len(q))]
        assert q.nbytes == 0
        return got

    assert asyncio.run(scenario()) == ["r"] + ["s"] * 6      # 700 tokens × 512 B in 64 KiB frames of 128 tokens


def test_handover_limits_are_checked():
    with pytest.raises(ConfigError, match="--handover-max-seconds"):
        HandoverLimits(max_seconds=0)
    with pytest.raises(ConfigError):
        HandoverLimits(max_tokens=-1)
