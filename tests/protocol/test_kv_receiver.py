"""KVReceiver without sockets: coverage by layer × tokens × heads, bounds, duplicates, overlaps, order
against PrefillDone, the Ack/Cancel decision and the bandwidth sample."""

import random

import pytest

from edgecore.protocol.kv_receiver import KVReceiver, ReceiveState, TransferFailed
from edgecore.protocol import messages as m

LAYERS, HEADS, TOTAL, SKIP = 3, 4, 40, 8


def chunk(layer0, layer1, t0, t1, h0=0, h1=HEADS, raw=100):
    return m.KVChunk("r", layer0, layer1, t0, t1, h0, h1, 16, "float32", "raw", raw // 2, raw, TOTAL)


def done():
    return m.PrefillDone("r", 7, -0.5, [(7, -0.5)], TOTAL, SKIP)


def pieces():
    """A full cover: per layer, tokens in two ranges × heads in two halves (16 chunks of one layer each)."""
    return [chunk(layer, layer + 1, t0, t1, h0, h1)
            for layer in range(LAYERS) for t0, t1 in ((SKIP, 20), (20, TOTAL)) for h0, h1 in ((0, 2), (2, HEADS))]


def receiver(direct=False):
    return KVReceiver("r", LAYERS, HEADS, TOTAL, SKIP, direct=direct)


def test_any_order_of_a_full_cover_then_done_completes_and_acks():
    for seed in range(20):
        order = pieces()
        random.Random(seed).shuffle(order)
        rx = receiver()
        for i, c in enumerate(order):
            assert not rx.covered
            rx.on_chunk(c, 50, float(i))
        assert rx.covered and rx.state is ReceiveState.RECEIVING      # still waits for PrefillDone
        rx.on_done(done())
        assert rx.complete and rx.closing_message() == m.Ack("r")


def test_chunks_spanning_several_layers_count_for_each():
    rx = receiver()
    rx.on_chunk(chunk(0, LAYERS, SKIP, TOTAL), 10, 0.0)
    rx.on_done(done())
    assert rx.complete


@pytest.mark.parametrize("bad", [
    chunk(0, 1, SKIP - 1, 20),          # before the tokens the edge asked for
    chunk(0, 1, 20, TOTAL + 1),         # past the prompt
    chunk(0, LAYERS + 1, SKIP, 20),     # a layer the model does not have
    chunk(-1, 1, SKIP, 20),
    chunk(1, 1, SKIP, 20),              # empty layer range
    chunk(0, 1, 20, 20),                # empty token range
    chunk(0, 1, SKIP, 20, 3, HEADS + 1),   # a head the model does not have
    chunk(0, 1, SKIP, 20, 2, 2),
])
def test_out_of_range_chunks_fail_the_transfer_and_cancel(bad):
    rx = receiver()
    with pytest.raises(TransferFailed, match="outside the request"):
        rx.on_chunk(bad, 10, 0.0)
    assert rx.state is ReceiveState.FAILED and rx.closing_message() == m.Cancel("r")
    with pytest.raises(TransferFailed):     # nothing is accepted after a failure
        rx.on_chunk(chunk(0, 1, SKIP, 20), 10, 1.0)


def test_a_duplicate_fails_at_once_even_while_other_chunks_are_missing():
    rx = receiver()
    rx.on_chunk(chunk(0, 1, SKIP, 20), 10, 0.0)
    with pytest.raises(TransferFailed, match="twice"):
        rx.on_chunk(chunk(0, 1, SKIP, 20), 10, 1.0)
    assert rx.closing_message() == m.Cancel("r")


@pytest.mark.parametrize("second", [
    chunk(0, 1, 15, 25),                # overlapping tokens, all heads
    chunk(0, 1, SKIP, 12, 1, 3),        # inside the first range, some heads
    chunk(0, 2, 19, 21, 0, 1),          # several layers, one of which overlaps
])
def test_overlapping_chunks_fail(second):
    rx = receiver()
    rx.on_chunk(chunk(0, 1, SKIP, 20), 10, 0.0)
    with pytest.raises(TransferFailed, match="twice"):
        rx.on_chunk(second, 10, 1.0)


def test_adjacent_ranges_do_not_overlap():
    rx = receiver()
    rx.on_chunk(chunk(0, 1, SKIP, 20, 0, 2), 10, 0.0)
    rx.on_chunk(chunk(0, 1, SKIP, 20, 2, 4), 10, 0.0)
    rx.on_chunk(chunk(0, 1, 20, TOTAL), 10, 0.0)
    assert rx.state is ReceiveState.RECEIVING


def test_one_sender_must_send_all_kv_before_prefill_done():
    rx = receiver()
    for c in pieces()[:-1]:
        rx.on_chunk(c, 10, 0.0)
    with pytest.raises(TransferFailed, match="incomplete"):
        rx.on_done(done())
    assert rx.closing_message() == m.Cancel("r")


def test_direct_streams_may_finish_after_prefill_done():
    rx = receiver(direct=True)
    order = pieces()
    for c in order[:5]:
        rx.on_chunk(c, 10, 0.0)
    rx.on_done(done())
    assert not rx.complete
    for c in order[5:]:
        rx.on_chunk(c, 10, 0.0)
    assert rx.complete and rx.closing_message() == m.Ack("r")
    with pytest.raises(TransferFailed):     # a chunk after completion is refused
        rx.on_chunk(chunk(0, 1, SKIP, 20), 10, 0.0)


def test_a_second_prefill_done_fails():
    rx = receiver(direct=True)
    rx.on_done(done())
    with pytest.raises(TransferFailed, match="second"):
        rx.on_done(done())


def test_errors_from_outside_and_abandoning_cancel():
    rx = receiver()
    with pytest.raises(TransferFailed, match="core error"):
        rx.fail("core error 3: busy")
    assert rx.failure == "core error 3: busy" and rx.closing_message() == m.Cancel("r")
    complete = receiver()
    complete.on_chunk(chunk(0, LAYERS, SKIP, TOTAL), 10, 0.0)
    complete.on_done(done())
    complete.abandon("activation failed")          # the edge could not use it: the core must still free it
    assert complete.closing_message() == m.Cancel("r")


def test_bandwidth_sample_counts_bytes_after_the_first_chunk():
    rx = receiver()
    assert rx.bandwidth_sample() == (0, 0.0)
    rx.on_chunk(chunk(0, 1, SKIP, TOTAL, raw=400), 1000, 10.0)
    rx.on_chunk(chunk(1, 2, SKIP, TOTAL, raw=400), 3000, 10.5)
    rx.on_chunk(chunk(2, 3, SKIP, TOTAL, raw=400), 5000, 12.0)
    assert rx.bandwidth_sample() == (8000, 2.0)
    assert rx.encoded_bytes == 9000 and rx.raw_bytes == 1200


def test_skip_tokens_must_leave_something_to_receive():
    with pytest.raises(ValueError, match="skip_tokens"):
        KVReceiver("r", LAYERS, HEADS, TOTAL, TOTAL)


def test_a_chunk_declaring_more_kv_than_the_model_holds_fails_before_it_is_decoded():
    """A chunk's header sizes what its decoder allocates: 2^40 values per head would be terabytes. Its raw_len
    must be exactly what this model's K and V take for the box (here head dim 16, so 32 values per head)."""
    rx = KVReceiver("r", LAYERS, HEADS, TOTAL, SKIP, values_per_head=32)
    tokens = TOTAL - SKIP
    good = m.KVChunk("r", 0, 1, SKIP, TOTAL, 0, HEADS, 16, "bfloat16", "q4e", 10, tokens * HEADS * 32 * 2, TOTAL)
    rx.on_chunk(good, 10, 0.0)
    for bad in (m.KVChunk("r", 1, 2, SKIP, TOTAL, 0, HEADS, 1 << 40, "bfloat16", "q4e", 10, 1 << 46, TOTAL),
                m.KVChunk("r", 1, 2, SKIP, TOTAL, 0, HEADS, 16, "float32", "q4e", 10, good.raw_len, TOTAL),
                m.KVChunk("r", 1, 2, SKIP, TOTAL, 0, HEADS, 16, "int8", "q4e", 10, good.raw_len, TOTAL)):
        rx = KVReceiver("r", LAYERS, HEADS, TOTAL, SKIP, values_per_head=32)
        with pytest.raises(TransferFailed, match="raw bytes where this model's KV takes"):
            rx.on_chunk(bad, 10, 0.0)
