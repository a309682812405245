"""Fuzzing: random and mutated byte streams end in NEED_DATA, BadFrame events or a ProtocolError —
never a crash, a hang, a buffer past the limits, or a mutated message delivered as if it were sent."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgecore.protocol.errors import ProtocolError
from edgecore.protocol.framing import Limits
from edgecore.protocol.kv import decode_chunk
from edgecore.protocol.state import NEED_DATA, BadFrame, KVData
from tests.protocol.pairs import READY_CLIENT_MSGS, handshake, new_pair, ready_server_msgs

LIMITS = Limits(max_header=4096, max_payload=1 << 16, max_buffer=1 << 17)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def consume(conn, data: bytes, splits: list[int]):
    """Feed data; return ('ok', events) or ('error', events delivered before the error). Any other
    exception fails the test."""
    events, pos = [], 0
    try:
        for size in splits + [len(data)]:
            conn.receive_data(data[pos:pos + size])
            pos += size
            for _ in range(10_000):          # bounded: a state machine must not loop forever
                ev = conn.next_event()
                if ev is NEED_DATA:
                    break
                events.append(ev)
                if isinstance(ev, KVData):
                    decode_chunk(ev)
            else:
                pytest.fail("next_event never returned NEED_DATA")
            assert conn.buffered <= LIMITS.max_buffer
    except ProtocolError:
        return "error", events
    return "ok", events


@FUZZ
@given(data=st.binary(max_size=600), splits=st.lists(st.integers(1, 64), max_size=8),
       ready=st.booleans(), side=st.sampled_from(["client", "server"]))
def test_random_bytes_never_crash(data, splits, ready, side):
    client, server = new_pair(limits=LIMITS)
    if ready:
        handshake(client, server)
    consume(client if side == "client" else server, data, splits)


def _valid_stream_to_client():
    client, server = new_pair(limits=LIMITS)
    handshake(client, server)
    return client, b"".join(server.send_bytes(msg) for msg in ready_server_msgs())


def _valid_stream_to_server():
    client, server = new_pair(limits=LIMITS)
    handshake(client, server)
    return server, b"".join(client.send_bytes(msg) for msg in READY_CLIENT_MSGS)


@FUZZ
@given(direction=st.sampled_from(["to_client", "to_server"]),
       mutations=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.integers(0, 10_000), splits=st.lists(st.integers(1, 200), max_size=6))
def test_mutated_valid_streams_never_crash(direction, mutations, cut, splits):
    conn, data = _valid_stream_to_client() if direction == "to_client" else _valid_stream_to_server()
    buf = bytearray(data)
    for pos, value in mutations:
        buf[pos % len(buf)] = value
    consume(conn, bytes(buf[: max(1, cut % (len(buf) + 1))]), splits)


def _same(a, b) -> bool:
    if isinstance(a, KVData):
        return isinstance(b, KVData) and a.chunk == b.chunk and bytes(a.payload) == bytes(b.payload)
    return a == b


@FUZZ
@given(direction=st.sampled_from(["to_client", "to_server"]),
       mutations=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4))
def test_mutations_never_deliver_a_message_that_was_not_sent(direction, mutations):
    """Whatever bytes change, every delivered message is one of the sent ones, in order."""
    sent = ready_server_msgs() if direction == "to_client" else READY_CLIENT_MSGS
    conn, data = _valid_stream_to_client() if direction == "to_client" else _valid_stream_to_server()
    buf = bytearray(data)
    for pos, xor in mutations:
        buf[pos % len(buf)] ^= xor
    kind, events = consume(conn, bytes(buf), [])
    delivered = [e for e in events if not isinstance(e, BadFrame)]
    it = iter(sent)
    assert all(any(_same(msg, ev) for msg in it) for ev in delivered)
