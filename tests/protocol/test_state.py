"""Sans-IO connection: round trips in any byte split, handshake checks, illegal transitions."""

import random

import numpy as np
import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from edgecore.protocol.framing import FIXED_SIZE, Limits, pack_fixed
from edgecore.protocol.kv import decode_chunk
from edgecore.protocol.state import KVData, State
from tests.protocol.pairs import (READY_CLIENT_MSGS, deliver, handshake, new_pair, ready_server_msgs,
                                  sample_kv)


def same(a, b):
    if isinstance(a, KVData):
        return a.chunk == b.chunk and bytes(a.payload) == bytes(b.payload)
    return a == b


@pytest.mark.parametrize("mode", ["whole", "bytewise", "random"])
def test_every_message_round_trips_in_any_split(mode):
    client, server = new_pair()
    rng = random.Random(7)

    def splits(n):
        if mode == "whole":
            return [n]
        if mode == "bytewise":
            return [1] * n
        out = []
        while sum(out) < n:
            out.append(rng.randint(1, 40))
        return out

    def move(sender, receiver, msg):
        data = sender.send_bytes(msg)
        events = deliver(data, receiver, splits(len(data)))
        assert len(events) == 1 and same(events[0], msg)
        return events[0]

    hello = move(client, server, client.hello())
    assert server.state is State.HELLO_RECEIVED and hello.name == "edge"
    move(server, client, server.welcome())
    move(client, server, client.auth())
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
    client, server = new_pair()
    handshake(client, server)
    kv = sample_kv()[2]
    parts = server.send(kv)
    assert len(parts) == 2 and parts[1] is kv.payload     # the payload view itself, not a copy


@pytest.mark.parametrize("sender, msg, state", [
    ("client", m.PrefillRequest("r", [1]), "START"),
    ("client", m.Auth(b"x" * 32), "START"),
    ("server", m.Welcome(1, [], "f", b"n" * 32), "START"),
    ("server", m.KVChunk("r", 0, 1, 0, 1, 0, 1, 1, "bfloat16", "raw", 2, 4, 0), "START"),
])
def test_illegal_sends_name_the_state(sender, msg, state):
    client, server = new_pair()
    conn = client if sender == "client" else server
    with pytest.raises(LocalProtocolError, match=state):
        conn.send_bytes(msg)


def test_illegal_receive_names_the_state():
    client, server = new_pair()
    handshake(client, server)
    # A server may not send a PrefillRequest; craft the bytes with a second, misused connection.
    rogue_client, rogue_server = new_pair()
    handshake(rogue_client, rogue_server)
    data = rogue_client.send_bytes(m.PrefillRequest("r", [1]))
    with pytest.raises(RemoteProtocolError, match="READY"):
        deliver(data, client)
    # Before the handshake a server must not receive a Ping.
    _, fresh = new_pair()
    with pytest.raises(RemoteProtocolError, match="START"):
        deliver(rogue_client.send_bytes(m.Ping(1)), fresh)


def test_wrong_secret_fails_on_both_sides():
    client, server = new_pair(secret_c=b"wrong")
    deliver(client.send_bytes(client.hello()), server)
    deliver(server.send_bytes(server.welcome()), client)
    with pytest.raises(RemoteProtocolError, match="wrong cluster secret") as exc:
        deliver(client.send_bytes(client.auth()), server)
    assert exc.value.code == ErrorCode.AUTH_FAILED
    # A server that does not know the secret cannot produce an AuthOk the client accepts.
    client, server = new_pair(secret_s=b"impostor")
    deliver(client.send_bytes(client.hello()), server)
    deliver(server.send_bytes(server.welcome()), client)
    client.send_bytes(client.auth())
    server.state = State.AUTH_RECEIVED          # impostor skips the check
    with pytest.raises(RemoteProtocolError, match="does not know the cluster secret"):
        deliver(server.send_bytes(server.auth_ok()), client)


def test_model_mismatch_is_refused_with_clear_message():
    client, server = new_pair(fp_c="a" * 64)
    with pytest.raises(RemoteProtocolError, match="model mismatch") as exc:
        deliver(client.send_bytes(client.hello()), server)
    assert exc.value.code == ErrorCode.MODEL_MISMATCH


def test_version_mismatch():
    client, server = new_pair()
    hello = m.Hello([99], ["raw"], client.fingerprint, b"n" * 32)
    with pytest.raises(RemoteProtocolError, match="no common protocol version") as exc:
        deliver(client.send_bytes(hello), server)
    assert exc.value.code == ErrorCode.VERSION_MISMATCH
    data = bytearray(new_pair()[0].send_bytes(client.hello()))
    data[4] = 7    # frame version byte
    with pytest.raises(RemoteProtocolError, match="version 7"):
        deliver(bytes(data), new_pair()[1])


def test_oversize_frame_rejected_before_allocation():
    _, server = new_pair(limits=Limits(max_header=1024, max_payload=1 << 20))
    header = pack_fixed(1, 6, 100, 1 << 30)     # claims a 1 GiB payload
    server.receive_data(header)
    with pytest.raises(RemoteProtocolError, match="exceeds the limit") as exc:
        server.next_event()
    assert exc.value.code == ErrorCode.FRAME_TOO_LARGE
    assert server.parser.buffered == FIXED_SIZE
    _, server = new_pair(limits=Limits(max_header=1024))
    server.receive_data(pack_fixed(1, 1, 5000, 0))
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
    header = m.encoder.encode(m.Ping(1))
    with pytest.raises(RemoteProtocolError, match="carry no payload"):
        deliver(pack_fixed(1, 11, len(header), 3) + header + b"abc", server)


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


def test_flipped_payload_bit_is_detected():
    client, server = new_pair()
    handshake(client, server)
    _, _, kv = sample_kv()
    data = bytearray(server.send_bytes(kv))
    data[-5] ^= 0x10
    [got] = deliver(bytes(data), client)
    with pytest.raises(ProtocolError, match="checksum") as exc:
        decode_chunk(got)
    assert exc.value.code == ErrorCode.CHECKSUM
