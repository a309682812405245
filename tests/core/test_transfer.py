"""The core's Transfer: only the transitions of its state diagram are taken."""

import asyncio

import torch

from edgecore.core.transfer import KVSend, Transfer, TransferState
from edgecore.shared.kv.transfer import KVSlice

S = TransferState


def transfer():
    return Transfer("s1/r", "r", asyncio.Queue(), "raw", 40, 8)


def test_ack_after_prefill_done_releases():
    t = transfer()
    assert t.state is S.PREFILLING and t.sent_until == 8
    assert t.prefill_done() and t.state is S.LEASED
    assert t.release() and t.state is S.RELEASED
    assert not t.cancel() and not t.prefill_done() and t.state is S.RELEASED   # terminal


def test_cancel_from_prefilling_or_leased_and_nothing_after():
    a = transfer()
    assert a.cancel() and a.cancelled
    assert not a.prefill_done() and not a.release() and a.state is S.CANCELLED
    b = transfer()
    b.prefill_done()
    assert b.cancel() and b.cancelled


def test_release_needs_the_prefill_to_be_done():
    t = transfer()
    assert not t.release() and t.state is S.PREFILLING


def test_a_worker_ranks_route_ends_sent():
    t = transfer()
    assert t.move(S.SENT) and not t.cancel() and t.state is S.SENT


def test_timings_and_a_slice_to_send():
    t = transfer()
    t.first_chunk_sent_at = t.received_at + 0.01
    timings = t.timings(t.received_at + 0.05)
    assert round(timings["total_ms"]) == 50 and round(timings["first_chunk_sent_ms"]) == 10
    assert "last_layer_done_ms" not in timings
    k = torch.zeros(2, 32, 4, 16)
    item = KVSend(t, KVSlice(1, 8, 40, 0, k, k))
    assert item.piece.num_layers == 2 and item.transfer is t


async def test_the_sender_drops_chunks_of_cancelled_transfers_and_keeps_order():
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from edgecore.core.kv_sender import send_queued
    from edgecore.protocol import messages as m

    class Peer:
        def __init__(self):
            self.sent = []
            self.conn = SimpleNamespace(peer_capabilities=[])     # what the edge's Auth advertised

        async def send(self, msg):
            self.sent.append(msg)

    live, gone = transfer(), transfer()
    gone.cancel()
    queue, peer = asyncio.Queue(), Peer()
    k = torch.randn(1, 32, 4, 16)
    for item in (KVSend(gone, KVSlice(0, 8, 40, 0, k, k)), KVSend(live, KVSlice(0, 8, 40, 0, k, k)),
                 KVSend(live, KVSlice(1, 8, 40, 0, k, k)), m.PrefillDone("r", 3)):
        queue.put_nowait(item)
    pool = ThreadPoolExecutor(1)
    task = asyncio.create_task(send_queued(queue, peer, pool, "float32"))
    for _ in range(100):
        if len(peer.sent) == 3:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    pool.shutdown()
    assert [c.chunk.layer_start for c in peer.sent[:2]] == [0, 1] and peer.sent[2] == m.PrefillDone("r", 3)
    assert peer.sent[0].chunk.token_start == 8 and live.first_chunk_sent_at is not None
