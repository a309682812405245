"""The state machine: one table for sends and receives, an ERROR state after any exception,
limits per state (small before authentication), buffers released on close."""

import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from edgecore.protocol.framing import HANDSHAKE_LIMITS, pack_fixed
from edgecore.protocol.state import TRANSITIONS, Role, State
from tests.protocol.pairs import deliver, forge, handshake, new_pair, sample_kv

SAMPLES = {
    m.Hello: lambda c: c.hello(), m.Welcome: lambda c: m.Welcome(2, b"w" * 32, c.key_share), m.Auth: lambda c: c.auth(),
    m.AuthOk: lambda c: m.AuthOk(c.fingerprint, ["raw"]), m.PrefillRequest: lambda c: m.PrefillRequest("r", [1]),
    m.KVChunk: lambda c: sample_kv()[2], m.PrefillDone: lambda c: m.PrefillDone("r", 1),
    m.Ack: lambda c: m.Ack("r"), m.Cancel: lambda c: m.Cancel("r"), m.Error: lambda c: m.Error(10, "x", "r"),
    m.Ping: lambda c: m.Ping(1), m.Pong: lambda c: m.Pong(1), m.Reject: lambda c: m.Reject(0, "x"),
}
STEPS = [  # (state both sides are in, sender role)
    (State.START, Role.CLIENT), (State.HELLO, Role.SERVER), (State.WELCOME, Role.CLIENT),
    (State.AUTH, Role.SERVER), (State.READY, Role.CLIENT), (State.READY, Role.SERVER),
]


def pair_in(state: State):
    client, server = new_pair()
    moves = [(client, server, client.hello), (server, client, server.welcome),
             (client, server, client.auth), (server, client, server.auth_ok)]
    for sender, receiver, make in moves[:[s for s, _ in STEPS].index(state)]:
        deliver(sender.send_bytes(make()), receiver)
    assert client.state is state and server.state is state
    return client, server


def verdicts(state: State, role: Role, cls) -> tuple[bool, bool]:
    """(may `role` send it, does the peer accept it) in `state`, each on a fresh pair."""
    client, server = pair_in(state)
    sender = client if role is Role.CLIENT else server
    msg = SAMPLES[cls](sender)
    try:
        sender.send(msg)
        may_send = True
    except LocalProtocolError:
        may_send = False
    client, server = pair_in(state)
    sender, receiver = (client, server) if role is Role.CLIENT else (server, client)
    msg = SAMPLES[cls](sender)
    wire = forge(sender, msg.chunk if cls is m.KVChunk else msg, msg.payload if cls is m.KVChunk else b"")
    try:
        deliver(wire, receiver)
        accepted = True
    except RemoteProtocolError as exc:
        # The table let a Reject through; naming a frame never sent is refused after that.
        accepted = cls is m.Reject and "does not remember" in str(exc)
    return may_send, accepted


@pytest.mark.parametrize("state, role", STEPS, ids=lambda x: getattr(x, "value", x))
def test_sending_and_receiving_follow_the_same_table(state, role):
    for cls in SAMPLES:
        may_send, accepted = verdicts(state, role, cls)
        in_table = (role, state, cls) in TRANSITIONS or (cls is m.Error)
        assert may_send == accepted == in_table, (state, role, cls.__name__, may_send, accepted)


def test_any_failure_moves_to_error_and_further_use_raises():
    client, server = new_pair()
    handshake(client, server)
    with pytest.raises(RemoteProtocolError):
        deliver(b"EDGC\x02" + b"\x00" * 40, server)          # fixed header fails its CRC
    assert server.state is State.ERROR
    with pytest.raises(RemoteProtocolError, match="ERROR"):
        server.next_event()
    with pytest.raises(LocalProtocolError, match="ERROR"):
        server.send(m.Ping(1))
    # The one thing still allowed: tell the peer why, which closes.
    [err] = deliver(server.error_frame("bad header", ErrorCode.CHECKSUM), client)
    assert err.code == ErrorCode.CHECKSUM and server.state is State.CLOSED and client.state is State.CLOSED


def test_an_illegal_send_moves_to_error_too():
    client, _ = new_pair()
    with pytest.raises(LocalProtocolError, match="START"):
        client.send(m.Ack("r"))
    assert client.state is State.ERROR
    with pytest.raises(LocalProtocolError):
        client.send(client.hello())


def test_an_unexpected_exception_inside_the_machine_moves_to_error(monkeypatch):
    client, server = new_pair()
    data = client.send_bytes(client.hello())

    class Boom(Exception):
        pass

    def explode(*_):
        raise Boom()
    monkeypatch.setattr(server, "_check_handshake", explode)
    with pytest.raises(Boom):
        deliver(data, server)
    assert server.state is State.ERROR


@pytest.mark.parametrize("header_len, payload_len", [(100, 64 << 20), (HANDSHAKE_LIMITS.max_header + 1, 0),
                                                      (10, 1)])
def test_before_authentication_only_small_frames(header_len, payload_len):
    _, server = new_pair()
    server.receive_data(pack_fixed(1, header_len, payload_len))
    with pytest.raises(RemoteProtocolError, match="exceeds the limit") as exc:
        server.next_event()
    assert exc.value.code == ErrorCode.FRAME_TOO_LARGE
    assert server.parser.capacity <= HANDSHAKE_LIMITS.max_buffer


def test_limits_grow_after_authentication_and_buffers_are_released_on_close():
    client, server = new_pair()
    assert server.parser.capacity <= HANDSHAKE_LIMITS.max_buffer
    handshake(client, server)
    big = sample_kv("raw", tokens=4000)[2]
    data = server.send_bytes(big)
    assert len(data) > HANDSHAKE_LIMITS.max_buffer
    [got] = deliver(data, client)
    assert bytes(got.payload) == bytes(big.payload)
    client.receive_data(data[:50_000])                 # a partial frame is buffered ...
    assert client.parser.capacity >= 50_000
    client.close()                                     # ... and released when the connection closes
    assert client.parser.capacity == 0 and client.state is State.CLOSED


def test_garbage_before_authentication_holds_only_a_small_buffer():
    _, server = new_pair()
    with pytest.raises(RemoteProtocolError):
        server.receive_data(b"EDGC\x02" + b"\x00" * (HANDSHAKE_LIMITS.max_buffer + 10))
    assert server.parser.capacity <= HANDSHAKE_LIMITS.max_buffer and server.state is State.ERROR
