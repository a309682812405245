"""Mixed protocol versions around the drain frame (sans-IO): a version-4 edge and core exchange Draining; an
edge or core of the previous release (versions 2 and 3, no Draining) still agrees version 3 with a version-4
peer and runs the whole version-3 request life cycle (PrefillRequest with core_decode, KV, PrefillDone, Token,
Handover, DecodeStop, Ack, a request Error), while the version-4 side is never allowed to send it Draining."""

import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from edgecore.protocol.state import Connection, Role, State
from tests.protocol.pairs import CODECS, FP, SECRET, deliver, forge, handshake, sample_kv

PREVIOUS = (2, 3)           # what the previous release speaks


def pair(client_versions=None, server_versions=None):
    client = Connection(Role.CLIENT, SECRET, FP, CODECS, name="edge", versions=client_versions)
    server = Connection(Role.SERVER, SECRET, FP, CODECS, name="core", versions=server_versions)
    handshake(client, server)
    return client, server


def test_current_peers_agree_version_4_and_exchange_draining():
    client, server = pair()
    assert client.version == server.version == m.DRAIN_VERSION == m.PROTOCOL_VERSION
    assert client.drain and server.drain and client.handover
    msg = m.Draining(30_000, "the core is shutting down")
    assert deliver(server.send_bytes(msg), client) == [msg]
    assert client.state is State.READY
    with pytest.raises(LocalProtocolError):          # only a core drains
        client.send_bytes(m.Draining(1))


def test_draining_takes_a_new_tag_and_the_previous_messages_keep_theirs():
    tags = {cls.__name__: tag for tag, cls in m.MESSAGE_TYPES.items()}
    assert tags.pop("Draining") == 17
    assert tags.pop("CacheDigest") == 18          # later: capabilities', not a version's
    assert tags.pop("BlockPull") == 19 and tags.pop("BlockPullDone") == 20
    assert sorted(tags.values()) == list(range(1, 17))


@pytest.mark.parametrize("old_side", ["edge", "core"])
def test_a_previous_release_peer_agrees_version_3_and_runs_the_v3_life_cycle(old_side):
    client, server = pair(PREVIOUS if old_side == "edge" else None, PREVIOUS if old_side == "core" else None)
    assert client.version == server.version == 3
    assert client.handover and server.handover and not client.drain and not server.drain
    # a whole version-3 request: core decode, KV, first token, tokens, handover, stop, ack
    req = m.PrefillRequest("req-1", [1, 2, 3], m.SamplingSpec(seed=1), ["lossless"], core_decode=8)
    assert deliver(client.send_bytes(req), server) == [req]
    _, _, kv = sample_kv()
    [chunk] = deliver(server.send_bytes(kv), client)
    assert chunk.chunk == kv.chunk
    for msg in (m.PrefillDone("req-1", 5), m.Token("req-1", 1, 7), m.DecodeStop("req-1", 2, "handover")):
        assert deliver(server.send_bytes(msg), client) == [msg]
    for msg in (m.Handover("req-1", 2), m.Ack("req-1")):
        assert deliver(client.send_bytes(msg), server) == [msg]
    # a draining version-4 core refuses new work with a request Error, which every release reads
    refusal = m.Error(ErrorCode.SHUTTING_DOWN, "draining", "req-2")
    assert deliver(server.send_bytes(refusal), client) == [refusal]
    assert client.state is State.READY and server.state is State.READY


def test_a_version_3_connection_never_carries_draining():
    client, server = pair(PREVIOUS, None)             # a current core, a previous-release edge
    with pytest.raises(LocalProtocolError, match="version-3 connection has no Draining"):
        server.send_bytes(m.Draining(1000))
    client, server = pair(PREVIOUS, None)
    with pytest.raises(RemoteProtocolError, match="unexpected Draining"):   # a forged one fails the connection
        deliver(forge(server, m.Draining(1000)), client)


def test_versions_are_checked():
    with pytest.raises(ValueError, match="must be among"):
        Connection(Role.CLIENT, SECRET, FP, CODECS, versions=(3, 9))
    client = Connection(Role.CLIENT, SECRET, FP, CODECS, versions=(2,))
    server = Connection(Role.SERVER, SECRET, FP, CODECS, versions=(3, 4))
    with pytest.raises(RemoteProtocolError, match="no common protocol version"):
        deliver(client.send_bytes(client.hello()), server)
