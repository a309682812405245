"""Decode handover in the sans-IO layer: version-3 messages in any byte split, the version-2 fallback, and
the per-request `CoreDecode` machine (positions, drops after the handover, protocol errors)."""

import os
import random

import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.errors import LocalProtocolError, RemoteProtocolError
from edgecore.protocol.handover import CoreDecode, HandoverError, Phase
from edgecore.protocol.state import State
from tests.protocol.pairs import deliver, forge, handshake, new_pair, split_sizes

V3_CLIENT = [m.PrefillRequest("r", [1, 2, 3], m.SamplingSpec(seed=3), ["lossless"], 0, 0, core_decode=30),
             m.Handover("r", 7)]
V3_SERVER = [m.Token("r", 1, 42), m.Token("r", 2, 9, -0.25, [(9, -0.25), (4, -1.5)]),
             m.DecodeStop("r", 3, "bound")]


@pytest.mark.parametrize("mode", ["whole", "bytewise", "random"])
def test_handover_messages_round_trip_in_any_split(mode):
    client, server = new_pair()
    handshake(client, server)
    assert client.version == server.version == m.PROTOCOL_VERSION and client.handover and server.handover
    rng = random.Random(3)
    for sender, receiver, msgs in ((client, server, V3_CLIENT), (server, client, V3_SERVER)):
        for msg in msgs:
            data = sender.send_bytes(msg)
            assert deliver(data, receiver, split_sizes(mode, len(data), rng, 17)) == [msg]
    assert client.state is State.READY and server.state is State.READY


def test_several_tokens_in_one_read_arrive_in_order():
    client, server = new_pair()
    handshake(client, server)
    tokens = [m.Token("r", p, 100 + p) for p in range(1, 40)]
    data = b"".join(server.send_bytes(t) for t in tokens)
    assert deliver(data, client) == tokens


def version2_pair(old_side: str):
    """A pair where one side supports only version 2 (its Hello offers [2], or its Welcome chooses 2)."""
    client, server = new_pair()
    hello = m.Hello([2], os.urandom(32), client.key_share) if old_side == "client" else client.hello()
    deliver(client.send_bytes(hello), server)
    if old_side == "server":
        server.version = 2                      # what a version-2 server chooses
    deliver(server.send_bytes(server.welcome()), client)
    deliver(client.send_bytes(client.auth()), server)
    deliver(server.send_bytes(server.auth_ok()), client)
    return client, server


@pytest.mark.parametrize("old_side", ["client", "server"])
def test_version_2_peer_keeps_the_old_mode(old_side):
    client, server = version2_pair(old_side)
    assert client.version == server.version == 2 and not client.handover and not server.handover
    # the old mode works: a plain PrefillRequest and PrefillDone
    req = m.PrefillRequest("r", [1, 2], m.SamplingSpec(), ["lossless"])
    assert deliver(client.send_bytes(req), server) == [req]
    done = m.PrefillDone("r", 5)
    assert deliver(server.send_bytes(done), client) == [done]
    # the new messages and core_decode are refused on both sides, naming the version
    with pytest.raises(LocalProtocolError, match="version-2 connection has no decode handover"):
        client.send_bytes(m.PrefillRequest("r2", [1, 2], core_decode=4))


@pytest.mark.parametrize("msg", V3_SERVER)
def test_version_2_client_rejects_handover_frames(msg):
    client, server = version2_pair("client")
    with pytest.raises(LocalProtocolError, match="no decode handover"):
        server.send_bytes(msg)
    client2, server2 = version2_pair("client")
    with pytest.raises(RemoteProtocolError, match=f"unexpected {type(msg).__name__}.*no decode handover"):
        deliver(forge(server2, msg), client2)


def test_version_2_server_rejects_handover_and_core_decode():
    for msg in (m.Handover("r", 3), m.PrefillRequest("r", [1], core_decode=2)):
        client, server = version2_pair("server")
        with pytest.raises(RemoteProtocolError, match="no decode handover"):
            deliver(forge(client, msg), server)


def test_direction_is_enforced():
    client, server = new_pair()
    handshake(client, server)
    with pytest.raises(LocalProtocolError):
        client.send_bytes(m.Token("r", 1, 2))
    client, server = new_pair()
    handshake(client, server)
    with pytest.raises(LocalProtocolError):
        server.send_bytes(m.Handover("r", 1))


# ---- the per-request machine ---------------------------------------------------------------------------
def streaming(limit=5):
    d = CoreDecode("r", limit)
    assert d.on_first(m.PrefillDone("r", 7)) is True
    return d


def test_tokens_in_order_then_handover_drops_late_ones():
    d = streaming()
    assert [d.on_token(m.Token("r", p, p)) for p in (1, 2, 3)] == [True] * 3
    ho = d.handover()
    assert ho == m.Handover("r", 4) and d.phase is Phase.HANDED_OVER and d.core_tokens == 4
    assert d.on_token(m.Token("r", 4, 0)) is False and d.dropped == 1     # in flight when the core stopped
    d.on_stop(m.DecodeStop("r", 5, "handover"))                           # the core's answer: ignored
    assert d.phase is Phase.HANDED_OVER and not d.core_active


def test_stop_at_the_bound_then_handover_at_that_position():
    d = streaming(limit=2)
    d.on_token(m.Token("r", 1, 1))
    d.on_token(m.Token("r", 2, 1))
    d.on_stop(m.DecodeStop("r", 3, "bound"))
    assert d.phase is Phase.STOPPED and d.stop_reason == "bound" and not d.core_active
    assert d.handover().position == 3


def test_refusal_means_handover_after_the_first_token():
    d = streaming()
    d.on_stop(m.DecodeStop("r", 1, "refused"))
    assert d.stop_reason == "refused" and d.handover().position == 1


def test_old_mode_limit_zero_expects_no_tokens():
    d = CoreDecode("r", 0)
    d.on_first(m.PrefillDone("r", 1))
    assert d.phase is Phase.STOPPED
    with pytest.raises(HandoverError):
        d.on_token(m.Token("r", 1, 1))


@pytest.mark.parametrize("bad", [
    m.Token("r", 2, 0),            # gap
    m.Token("r", 0, 0),            # repeat of the first token
    m.Token("x", 1, 0),            # another request's token
])
def test_broken_streams_fail(bad):
    d = streaming()
    with pytest.raises(HandoverError):
        d.on_token(bad)
    assert d.phase is Phase.FAILED


def test_token_beyond_the_limit_and_after_stop_fail():
    d = streaming(limit=1)
    d.on_token(m.Token("r", 1, 0))
    with pytest.raises(HandoverError, match="beyond"):
        d.on_token(m.Token("r", 2, 0))
    d = streaming()
    d.on_stop(m.DecodeStop("r", 1, "bound"))
    with pytest.raises(HandoverError, match="stopped"):
        d.on_token(m.Token("r", 1, 0))


def test_token_before_first_and_stop_at_wrong_position_fail():
    with pytest.raises(HandoverError):
        CoreDecode("r", 3).on_token(m.Token("r", 1, 0))
    d = streaming()
    with pytest.raises(HandoverError, match="DecodeStop at position 4"):
        d.on_stop(m.DecodeStop("r", 4, "bound"))


def test_finished_before_handover_drops_everything_after():
    d = streaming()
    d.on_token(m.Token("r", 1, 0))
    d.finish()
    assert d.on_token(m.Token("r", 2, 0)) is False and not d.core_active
    with pytest.raises(HandoverError):
        d.handover()
