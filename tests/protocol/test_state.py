"""Sans-IO connection: round trips in any byte split, handshake checks, illegal transitions."""

import random

import numpy as np
import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from edgecore.protocol.framing import FIXED_SIZE, SEALED, Limits, pack_fixed
from edgecore.protocol.kv import decode_chunk
from edgecore.protocol.state import BadFrame, KVData, State
from tests.protocol.pairs import (READY_CLIENT_MSGS, deliver, forge, handshake, new_pair, ready_server_msgs,
                                  sample_kv, split_sizes)


def same(a, b):
    if isinstance(a, KVData):
        return a.chunk == b.chunk and bytes(a.payload) == bytes(b.payload)
    return a == b


@pytest.mark.parametrize("mode", ["whole", "bytewise", "random"])
def test_every_message_round_trips_in_any_split(mode):
    client, server = new_pair()
    rng = random.Random(7)

    def move(sender, receiver, msg):
        data = sender.send_bytes(msg)
        events = deliver(data, receiver, split_sizes(mode, len(data), rng))
        assert len(events) == 1 and same(events[0], msg)
        return events[0]

    move(client, server, client.hello())
    assert server.state is State.HELLO and client.state is State.HELLO
    move(server, client, server.welcome())
    auth = move(client, server, client.auth())
    assert auth.name == "edge" and server.peer_name == "edge"
    move(server, client, server.auth_ok())
    assert client.state is State.READY and server.state is State.READY
    assert client.peer_layout == {"tp": 1} and client.peer_codecs == ["raw", "lossless", "int8"]
    for msg in READY_CLIENT_MSGS:
        move(client, server, msg)
    for msg in ready_server_msgs():
        move(server, client, msg)
    assert client.state is State.READY and server.state is State.READY


def test_several_frames_in_one_read():
    client, server = new_pair()
    handshake(client, server)
    data = b"".join(client.send_bytes(msg) for msg in READY_CLIENT_MSGS)
    assert deliver(data, server) == READY_CLIENT_MSGS


def test_kv_payload_is_sent_without_copy():
    """Authenticated-only frames hand the payload view itself to the socket; sealed frames encrypt it into
    a new buffer of the same size and leave the sender's KV untouched."""
    client, server = new_pair(sealed=False)
    handshake(client, server)
    kv = sample_kv()[2]
    parts = server.send(kv)
    assert len(parts) == 3 and parts[1] is kv.payload     # the payload view itself, not a copy
    assert len(parts[2]) == 16                              # then the tag
    client, server = new_pair()
    handshake(client, server)
    before = bytes(kv.payload)
    parts = server.send(kv)
    assert len(parts) == 3 and len(parts[1]) == kv.payload.nbytes and bytes(parts[1]) != before
    assert bytes(kv.payload) == before and len(parts[2]) == 16


@pytest.mark.parametrize("sender, msg, state", [
    ("client", m.PrefillRequest("r", [1]), "START"),
    ("client", m.Auth("f" * 64, ["raw"]), "START"),
    ("server", m.Welcome(2, b"n" * 32), "START"),
    ("server", m.KVChunk("r", 0, 1, 0, 1, 0, 1, 1, "bfloat16", "raw", 2, 4), "START"),
])
def test_illegal_sends_name_the_state(sender, msg, state):
    client, server = new_pair()
    conn = client if sender == "client" else server
    with pytest.raises(LocalProtocolError, match=state):
        conn.send_bytes(msg)


def test_illegal_receive_names_the_state():
    client, server = new_pair()
    handshake(client, server)
    # A server may not send a PrefillRequest: a misbehaving server that holds the keys forges one.
    with pytest.raises(RemoteProtocolError, match="unexpected PrefillRequest from peer in state READY"):
        deliver(forge(server, m.PrefillRequest("r", [1])), client)
    assert client.state is State.ERROR
    # Before the handshake a server must not receive a Ping (tagged under the handshake key).
    fresh_client, fresh = new_pair()
    with pytest.raises(RemoteProtocolError, match="unexpected Ping from peer in state START"):
        deliver(forge(fresh_client, m.Ping(1)), fresh)


def test_wrong_secret_fails_on_both_sides():
    client, server = new_pair(secret_c=b"wrong")
    with pytest.raises(RemoteProtocolError, match="Hello frame failed its MAC.*wrong cluster secret") as exc:
        deliver(client.send_bytes(client.hello()), server)
    assert exc.value.code == ErrorCode.AUTH_FAILED
    # The server's Error cannot be verified by a client with another secret: delivered, marked unverified.
    [err] = deliver(server.error_frame(exc.value), client)
    assert err.code == ErrorCode.AUTH_FAILED and "unverified" in err.message and client.state is State.CLOSED
    # A server that does not know the secret cannot produce a Welcome the client accepts.
    client, server = new_pair(secret_s=b"impostor")
    hello = client.hello()
    client.send_bytes(hello)
    server.state, server.version = State.HELLO, 2      # impostor skips the Hello check
    server._exchange(hello.key_share)                   # (the client's key share is public)
    with pytest.raises(RemoteProtocolError, match="Welcome frame failed its MAC") as exc:
        deliver(server.send_bytes(server.welcome()), client)
    assert exc.value.code == ErrorCode.AUTH_FAILED and client.state is State.ERROR


def test_model_mismatch_is_refused_only_after_authentication():
    client, server = new_pair(fp_c="a" * 64)
    hello_bytes = client.send_bytes(client.hello())
    deliver(hello_bytes, server)
    welcome_bytes = server.send_bytes(server.welcome())
    # Nothing before authentication names the model, the layout, the codecs or the node.
    for field in (b"f" * 16, b"a" * 16, b"core", b"edge", b"tp", b"lossless"):
        assert field not in welcome_bytes and field not in hello_bytes
    deliver(welcome_bytes, client)
    with pytest.raises(RemoteProtocolError, match="model mismatch") as exc:
        deliver(client.send_bytes(client.auth()), server)
    assert exc.value.code == ErrorCode.MODEL_MISMATCH
    # The refusal goes to an authenticated peer: it verifies.
    [err] = deliver(server.error_frame(exc.value), client)
    assert err.code == ErrorCode.MODEL_MISMATCH and "unverified" not in err.message


def test_version_mismatch():
    client, server = new_pair()
    hello = m.Hello([99], b"n" * 32)
    with pytest.raises(RemoteProtocolError, match="no common protocol version") as exc:
        deliver(client.send_bytes(hello), server)
    assert exc.value.code == ErrorCode.VERSION_MISMATCH
    data = bytearray(new_pair()[0].send_bytes(client.hello()))
    data[4] = 7    # frame version byte
    with pytest.raises(RemoteProtocolError, match="version 7"):
        deliver(bytes(data), new_pair()[1])


def test_oversize_frame_rejected_before_allocation():
    client, server = new_pair(limits=Limits(max_header=1024, max_payload=1 << 20))
    handshake(client, server)
    header = pack_fixed(6, 100, 1 << 30)     # claims a 1 GiB payload
    server.receive_data(header)
    with pytest.raises(RemoteProtocolError, match="exceeds the limit") as exc:
        server.next_event()
    assert exc.value.code == ErrorCode.FRAME_TOO_LARGE
    assert server.buffered == FIXED_SIZE and server.parser.capacity <= 1 << 16
    client, server = new_pair(limits=Limits(max_header=1024))
    handshake(client, server)
    server.receive_data(pack_fixed(5, 5000, 0))
    with pytest.raises(RemoteProtocolError, match="header of 5000 bytes"):
        server.next_event()


def test_truncated_frame_waits_for_more_data():
    client, server = new_pair()
    data = client.send_bytes(client.hello())
    assert deliver(data[:-1], server) == []
    assert server.state is State.START
    assert len(deliver(data[-1:], server)) == 1


def test_error_frame_closes_connection():
    client, server = new_pair()
    handshake(client, server)
    data = server.error_frame(RemoteProtocolError("boom", ErrorCode.CHECKSUM))
    assert server.state is State.CLOSED
    [err] = deliver(data, client)
    assert err.code == ErrorCode.CHECKSUM and "boom" in err.message and client.state is State.CLOSED
    with pytest.raises(LocalProtocolError, match="CLOSED"):
        client.send_bytes(m.Ping(1))


def test_payload_on_a_message_that_has_none_is_rejected():
    client, server = new_pair()
    handshake(client, server)
    with pytest.raises(RemoteProtocolError, match="carry no payload"):
        deliver(forge(client, m.Ping(1), b"abc"), server)


@pytest.mark.parametrize("codec", ["raw", "lossless", "int8", "int4", "fp8"])
def test_kv_chunk_round_trip_through_frames(codec):
    client, server = new_pair()
    handshake(client, server)
    k, v, kv = sample_kv(codec)
    [got] = deliver(server.send_bytes(kv), client, [3] * 2000)
    k2, v2 = decode_chunk(got)
    assert k2.shape == k.shape and k2.dtype == np.uint16
    if codec in ("raw", "lossless"):
        assert (k2 == k).all() and (v2 == v).all()


def test_flipped_payload_bit_is_detected_before_decoding():
    client, server = new_pair()
    handshake(client, server)
    _, _, kv = sample_kv()
    data = bytearray(server.send_bytes(kv))
    data[-20] ^= 0x10                      # the payload's last byte (the tag is the last 16)
    [got] = deliver(bytes(data), client)
    assert isinstance(got, BadFrame) and got.frame_type == SEALED and client.state is State.READY


def test_payload_views_of_wider_items_are_framed_by_bytes():
    client, server = new_pair()
    handshake(client, server)
    k, v, kv = sample_kv("raw")
    wide = memoryview(np.frombuffer(bytes(kv.payload), dtype=np.uint16))     # len() counts items, not bytes
    [got] = deliver(server.send_bytes(KVData(kv.chunk, wide)), client)
    k2, v2 = decode_chunk(got)
    assert (k2 == k).all() and (v2 == v).all()
