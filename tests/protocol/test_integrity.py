"""Frame integrity (sans-IO): every single-bit flip is detected, replays/drops/reorders fail the
connection, a bad frame fails only its request, and an old (version 1) peer gets a clear error."""

import random

import msgspec
import numpy as np
import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode, RemoteProtocolError
from edgecore.protocol.framing import FIXED_SIZE, LEGACY_VERSION, pack_fixed
from edgecore.protocol.kv import encode_chunk
from edgecore.protocol.state import NEED_DATA, BadFrame, FrameRejected, KVData, State
from tests.protocol.pairs import READY_CLIENT_MSGS, deliver, handshake, new_pair, ready_server_msgs, sample_kv


def ready_pair():
    client, server = new_pair()
    handshake(client, server)
    return client, server


def flip(data: bytes, bit: int) -> bytes:
    buf = bytearray(data)
    buf[bit // 8] ^= 1 << (bit % 8)
    return bytes(buf)


class Link:
    """One direction of a READY pair; renewed whenever a flip killed the connection."""

    def __init__(self, direction: str):
        self.direction = direction
        self.renew()

    def renew(self):
        client, server = ready_pair()
        self.sender, self.receiver = (server, client) if self.direction == "to_client" else (client, server)

    def try_flipped(self, msg, bit: int) -> str:
        data = self.sender.send_bytes(msg)
        try:
            events = deliver(flip(data, bit % (len(data) * 8)), self.receiver)
        except RemoteProtocolError as exc:
            assert exc.code in (ErrorCode.CHECKSUM, ErrorCode.PROTOCOL, ErrorCode.VERSION_MISMATCH)
            assert self.receiver.state is State.ERROR
            self.renew()
            return "connection"
        assert len(events) == 1 and isinstance(events[0], BadFrame), events   # never a message
        # A good frame afterwards is accepted: the connection recovered from one bad frame.
        assert deliver(self.sender.send_bytes(m.Ping(9)), self.receiver) == [m.Ping(9)]
        return "frame"


@pytest.mark.parametrize("direction", ["to_client", "to_server"])
def test_every_single_bit_flip_of_small_frames_is_detected(direction):
    link = Link(direction)
    msgs = ready_server_msgs() if direction == "to_client" else READY_CLIENT_MSGS
    msgs = [sample_kv("raw", tokens=1)[2] if isinstance(x, KVData) else x for x in msgs]
    for msg in msgs:
        size = len(link.sender.send_bytes(msg))
        deliver(b"", link.receiver)
        link.renew()
        outcomes = [link.try_flipped(msg, bit) for bit in range(size * 8)]
        # Flips in the fixed header make the stream unparseable: the connection fails. Every other
        # flip (header, payload, tag) fails that frame only.
        assert outcomes == ["connection"] * (FIXED_SIZE * 8) + ["frame"] * ((size - FIXED_SIZE) * 8)


def test_sampled_bit_flips_of_a_large_kv_frame_are_detected():
    rng = np.random.default_rng(1)
    k = rng.integers(0, 65535, size=(1, 4096, 4, 32), dtype=np.uint16)
    kv = encode_chunk("big", k, k, layer_start=0, token_start=0, dtype="bfloat16", codec="raw")
    link = Link("to_client")
    size = len(link.sender.send_bytes(kv))
    assert size > 1 << 20
    link.renew()
    bits = random.Random(2).sample(range(FIXED_SIZE * 8, size * 8), 40)
    assert all(link.try_flipped(kv, bit) == "frame" for bit in bits)


def frames(sender, msgs):
    return [sender.send_bytes(msg) for msg in msgs]


def test_replayed_frame_fails_the_connection():
    client, server = ready_pair()
    a, b = frames(client, [m.Ping(1), m.Ack("r")])
    assert deliver(a, server) == [m.Ping(1)]
    [bad] = deliver(a, server)                     # the same bytes again: wrong sequence number
    assert isinstance(bad, BadFrame)
    with pytest.raises(RemoteProtocolError, match="two frames in a row") as exc:
        deliver(b, server)
    assert exc.value.code == ErrorCode.CHECKSUM and server.state is State.ERROR


def test_reordered_frames_fail_the_connection():
    client, server = ready_pair()
    a, b = frames(client, [m.Ack("r1"), m.Ack("r2")])
    assert isinstance(deliver(b, server)[0], BadFrame)
    with pytest.raises(RemoteProtocolError, match="two frames in a row"):
        deliver(a, server)


def test_dropped_frame_is_named_then_the_connection_fails():
    client, server = ready_pair()
    a, lost, c, d = frames(server, [m.Ping(1), m.PrefillDone("r", 5), m.Ping(2), m.Ping(3)])
    assert deliver(a, client) == [m.Ping(1)]
    [bad] = deliver(c, client)
    # The receiver names the seq it expected: the sender maps it back to the lost frame.
    [rejected] = deliver(client.send_bytes(bad.reject()), server)
    assert isinstance(rejected, FrameRejected) and rejected.message == m.PrefillDone("r", 5)
    with pytest.raises(RemoteProtocolError, match="two frames in a row"):
        deliver(d, client)


def test_frame_from_another_connection_is_rejected():
    client, server = ready_pair()
    other_client, other_server = ready_pair()
    [bad] = deliver(other_server.send_bytes(m.PrefillDone("r", 5)), client)
    assert isinstance(bad, BadFrame)


@pytest.mark.parametrize("msg, action", [
    (m.PrefillRequest("r1", [1, 2]), "deliver"),
    (m.Ack("r1"), "resend"),
    (m.Cancel("r1"), "resend"),
    (m.Ping(4), "nothing"),
])
def test_a_corrupted_edge_frame_fails_only_its_request(msg, action):
    client, server = ready_pair()
    data = client.send_bytes(msg)
    ok = client.send_bytes(m.PrefillRequest("other", [3]))
    [bad] = deliver(flip(data, len(data) * 8 - 3), server)
    assert isinstance(bad, BadFrame) and deliver(ok, server) == [m.PrefillRequest("other", [3])]
    [rejected] = deliver(server.send_bytes(bad.reject()), client)
    assert rejected.message == msg and client.state is State.READY
    plan = rejected.recovery()
    if action == "deliver":
        assert plan.deliver.request_id == "r1" and plan.deliver.code == ErrorCode.CHECKSUM and not plan.send
    elif action == "resend":
        assert plan.send == (msg,) and plan.deliver is None
        assert deliver(client.send_bytes(msg), server) == [msg]
    else:
        assert plan.send == () and plan.deliver is None


@pytest.mark.parametrize("msg", [sample_kv()[2], m.PrefillDone("req-1", 42)])
def test_a_corrupted_core_frame_fails_only_its_request(msg):
    client, server = ready_pair()
    data = server.send_bytes(msg)
    [bad] = deliver(flip(data, 200), client)                  # a bit in the message header
    assert isinstance(bad, BadFrame)
    [rejected] = deliver(client.send_bytes(bad.reject()), server)
    plan = rejected.recovery()
    [error] = plan.send
    assert error.request_id == "req-1" and error.code == ErrorCode.CHECKSUM and "corrupted" in error.message
    assert deliver(server.send_bytes(error), client) == [error]
    assert client.state is State.READY and server.state is State.READY


def test_reject_of_a_frame_never_sent_fails_the_connection():
    client, server = ready_pair()
    with pytest.raises(RemoteProtocolError, match="does not remember"):
        deliver(client.send_bytes(m.Reject(12345, "?")), server)


def legacy_frame(msg_fields: list) -> bytes:
    header = msgspec.msgpack.encode(msg_fields)
    return pack_fixed(msg_fields[0], len(header), 0, LEGACY_VERSION) + header


def test_old_peer_gets_a_clear_error_it_can_read():
    _, server = new_pair()
    old_hello = legacy_frame([1, [1], ["raw"], "f" * 64, b"n" * 32])
    with pytest.raises(RemoteProtocolError, match="version mismatch.*version 2, the peer version 1") as exc:
        deliver(old_hello, server)
    assert exc.value.code == ErrorCode.VERSION_MISMATCH
    reply = server.error_frame(exc.value)
    # Version 1 framing: 16-byte header, version byte 1, no tag — what an old peer parses.
    assert reply[4] == LEGACY_VERSION and len(reply) == 16 + int.from_bytes(reply[8:12], "little")
    tag, code, message = msgspec.msgpack.decode(reply[16:])[:3]
    assert tag == 10 and code == ErrorCode.VERSION_MISMATCH and "run the same edgecore release" in message


def test_new_client_reports_an_old_cores_refusal():
    client, _ = new_pair()
    client.send_bytes(client.hello())
    old_error = legacy_frame([10, 2, "peer speaks protocol version 2; this side supports [1]"])
    with pytest.raises(RemoteProtocolError, match="peer version 1.*the peer says: peer speaks protocol version 2"):
        deliver(old_error, client)


def deliver_buffered(data: bytes, conn, piece: int) -> list:
    """As asyncio's BufferedProtocol does: receive into the connection's buffer, `piece` bytes at a time."""
    events, pos = [], 0
    while pos < len(data):
        buf = conn.get_buffer()
        n = min(piece, len(buf), len(data) - pos)
        buf[:n] = data[pos:pos + n]
        del buf
        conn.buffer_updated(n)
        pos += n
        while conn.full or pos == len(data):
            ev = conn.next_event()
            if ev is NEED_DATA:
                break
            events.append(ev)
    return events


@pytest.mark.parametrize("piece", [4096, 65536, 300_000])
def test_large_frames_are_verified_as_their_bytes_arrive(piece):
    client, server = ready_pair()
    rng = np.random.default_rng(3)
    k = rng.integers(0, 65535, size=(1, 2048, 4, 32), dtype=np.uint16)
    kv = encode_chunk("big", k, k, layer_start=0, token_start=0, dtype="bfloat16", codec="raw")
    good = server.send_bytes(kv)
    bad = flip(server.send_bytes(kv), len(good) * 8 // 2)            # a payload bit, mid-frame
    after = server.send_bytes(kv)
    one_shot = []
    verify = client._recv_mac.verify
    client._recv_mac.verify = lambda seq, signed, tag: one_shot.append(signed.nbytes) or verify(seq, signed, tag)
    events = deliver_buffered(good + bad + after, client, piece)
    assert one_shot == []                     # all three verified incrementally, none in one pass at the end
    assert [type(e) for e in events] == [KVData, BadFrame, KVData]
    assert bytes(events[0].payload) == bytes(kv.payload) == bytes(events[2].payload)
    assert client._incoming is None

