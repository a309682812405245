"""Per-node credentials in the handshake: an edge and a core each prove their own credential, certified by the
cluster authority, with no cluster secret; every refusal names why (expired, not yet valid, revoked, wrong
role, unknown authority, forged, key not held); an authority rollover accepts both authorities during the
overlap; a credential revoked while connected closes its connection within the watch interval."""

import asyncio
import base64
import logging

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgecore.protocol import messages as m
from edgecore.protocol.credentials import Authority, NodeIdentity, Trust, load_authorities
from edgecore.protocol.errors import ErrorCode, RemoteProtocolError
from edgecore.protocol.state import Connection, Role, State
from edgecore.protocol.transport import PeerError, Timeouts, connect, serve
from tests.protocol.pairs import CODECS, FP, deliver, handshake

pytestmark = pytest.mark.timeout(30)
NOW = 1_800_000_000.0


def identity(authority: Authority, name: str, role: str, days: float = 30, now: float = NOW) -> NodeIdentity:
    key = Ed25519PrivateKey.generate()
    return NodeIdentity(authority.issue(name, role, "eu", key, days, now=now), key)


def pair(edge: NodeIdentity, core: NodeIdentity, trust_edge: Trust, trust_core: Trust, secret: bytes = b""):
    client = Connection(Role.CLIENT, secret, FP, CODECS, name="edge", identity=edge, trust=trust_edge)
    server = Connection(Role.SERVER, secret, FP, CODECS, name="core", layout={"tp": 1}, identity=core,
                        trust=trust_core)
    return client, server


def trusting(*authorities: Authority, clock=lambda: NOW, revocations=None) -> Trust:
    return Trust({a.id: a.public for a in authorities}, revocations, clock=clock)


def test_nodes_prove_their_own_credentials_without_a_cluster_secret():
    auth = Authority.generate()
    client, server = pair(identity(auth, "edge-eu-1", "edge"), identity(auth, "core-eu-1", "core"),
                          trusting(auth), trusting(auth))
    handshake(client, server)
    assert client.state is server.state is State.READY and client.sealed
    assert client.peer_credential.name == "core-eu-1" and server.peer_credential.name == "edge-eu-1"
    assert deliver(client.send_bytes(m.Ping(3)), server) == [m.Ping(3)]


def refusal(client, server) -> str:
    """Run the handshake until a side refuses; the refusal's message."""
    with pytest.raises(RemoteProtocolError) as exc:
        handshake(client, server)
    assert exc.value.code == ErrorCode.AUTH_FAILED
    return str(exc.value)


@pytest.mark.parametrize("case, needle", [
    ("expired", "expired"), ("not yet valid", "not valid yet"), ("wrong role", "role"),
    ("unknown authority", "unknown authority"), ("forged", "signature"), ("key not held", "did not prove"),
    ("no credential", "no credential"), ("revoked", "revoked")])
def test_each_refusal_names_its_reason(case, needle, tmp_path):
    auth, other = Authority.generate(), Authority.generate()
    edge, core = identity(auth, "edge-1", "edge"), identity(auth, "core-1", "core")
    trust_core = trusting(auth)
    if case == "expired":
        edge = identity(auth, "edge-1", "edge", days=1, now=NOW - 3 * 86400)
    elif case == "not yet valid":
        edge = identity(auth, "edge-1", "edge", now=NOW + 3600)
    elif case == "wrong role":
        edge = identity(auth, "core-2", "core")               # a core's credential acting as an edge
    elif case == "unknown authority":
        edge = identity(other, "edge-1", "edge")
    elif case == "forged":
        signed = bytearray(edge.signed)
        signed[5] ^= 1                                         # inside the credential body
        edge = NodeIdentity(bytes(signed), edge.private)
    elif case == "key not held":
        edge = NodeIdentity(edge.signed, Ed25519PrivateKey.generate())     # a copied credential, not its key
    elif case == "revoked":
        (tmp_path / "revoked").write_text(f"{edge.credential.serial} edge-1 leaked\n")
        trust_core = trusting(auth, revocations=tmp_path / "revoked")
    client, server = pair(edge, core, trusting(auth), trust_core)
    if case == "no credential":                                # an edge with only the cluster secret
        client = Connection(Role.CLIENT, b"x", FP, CODECS, name="edge")
        server = Connection(Role.SERVER, b"x", FP, CODECS, name="core", layout={"tp": 1}, identity=core,
                            trust=trust_core)
    assert needle in refusal(client, server)


def test_the_edge_refuses_a_core_with_an_edge_credential():
    auth = Authority.generate()
    impostor = identity(auth, "edge-2", "edge")              # another edge's credential, acting as a core
    client = Connection(Role.CLIENT, b"", FP, CODECS, name="edge", identity=identity(auth, "edge-1", "edge"),
                        trust=trusting(auth))
    server = Connection(Role.SERVER, b"", FP, CODECS, name="core", layout={"tp": 1}, identity=impostor,
                        trust=Trust({}, clock=lambda: NOW))    # (it checks nothing it could be refused by)
    server._trust = None
    assert "must be a core" in refusal(client, server)


def test_a_peer_edge_link_wants_an_edge_credential_on_both_sides_and_refuses_a_core():
    """An edge pulling cached KV from a peer edge (server_role "edge"): the peer's edge credential is accepted, a
    core's is refused; the serving edge checks the client's edge credential as a core does."""
    auth = Authority.generate()
    for server_id, ok in ((identity(auth, "edge-2", "edge"), True), (identity(auth, "core-1", "core"), False)):
        client = Connection(Role.CLIENT, b"", FP, CODECS, name="edge-1", identity=identity(auth, "edge-1", "edge"),
                            trust=trusting(auth), server_role="edge")
        server = Connection(Role.SERVER, b"", FP, CODECS, name="edge-2", identity=server_id, trust=trusting(auth),
                            capabilities=[*m.CAPABILITIES, m.BLOCK_PULL])
        if not ok:
            assert "must be an edge" in refusal(client, server)
            continue
        handshake(client, server)
        assert client.peer_credential.role == server.peer_credential.role == "edge"
        pull = m.BlockPull("p1", 16, b"\1" * 16)
        assert deliver(client.send_bytes(pull), server) == [pull]
        assert deliver(server.send_bytes(m.BlockPullDone("p1", 0)), client) == [m.BlockPullDone("p1", 0)]


def test_an_authority_rollover_accepts_both_during_the_overlap_then_only_the_new(tmp_path):
    old, new = Authority.generate(), Authority.generate()
    (tmp_path / "trusted").write_text(f"authority {base64.b64encode(old.public).decode()}\n"
                                      f"authority {base64.b64encode(new.public).decode()}\n")
    overlap = Trust(load_authorities(tmp_path / "trusted"), clock=lambda: NOW)
    for issuer in (old, new):
        client, server = pair(identity(issuer, "edge-1", "edge"), identity(new, "core-1", "core"),
                              trusting(new, old), overlap)
        handshake(client, server)
        assert server.peer_credential.authority == issuer.id
    client, server = pair(identity(old, "edge-1", "edge"), identity(new, "core-1", "core"), trusting(new),
                          trusting(new))
    assert "unknown authority" in refusal(client, server)


def test_a_credential_file_round_trips(tmp_path):
    auth = Authority.generate()
    node = identity(auth, "edge-1", "edge")
    (tmp_path / "edge-1.cred").write_text(node.dumps())
    loaded = NodeIdentity.load(tmp_path / "edge-1.cred")
    assert loaded.signed == node.signed and loaded.credential == node.credential


async def test_a_credential_revoked_while_connected_closes_its_connection(tmp_path, caplog):
    auth = Authority.generate()
    edge, core = identity(auth, "edge-1", "edge"), identity(auth, "core-1", "core")
    revoked = tmp_path / "revoked"
    revoked.write_text("# serials\n")
    trust_core = Trust({auth.id: auth.public}, revoked, clock=lambda: NOW, interval=0.05)
    fast = Timeouts(handshake=2, idle=10, heartbeat=0)

    async def echo(peer):
        while True:
            msg = await peer.recv()
            if isinstance(msg, m.PrefillRequest):
                await peer.send(m.PrefillDone(msg.request_id, 1))
    server = await serve(echo, secret=b"", fingerprint=FP, codecs=CODECS, timeouts=fast, layout={"tp": 1},
                         identity=core, trust=trust_core)
    async with server:
        port = server.sockets[0].getsockname()[1]
        peer = await connect("127.0.0.1", port, secret=b"", fingerprint=FP, codecs=CODECS, timeouts=fast,
                             identity=edge, trust=trusting(auth))
        await peer.send(m.PrefillRequest("r1", [1, 2]))
        assert await asyncio.wait_for(peer.recv(), 5) == m.PrefillDone("r1", 1)
        with caplog.at_level(logging.WARNING):
            revoked.write_text(f"# serials\n{edge.credential.serial}\n")
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(PeerError, match="revoked"):
                await asyncio.wait_for(peer.recv(), 5)
            assert loop.time() - start < 2
        assert any("was revoked" in r.getMessage() for r in caplog.records)
        with pytest.raises(PeerError, match="revoked"):       # and it cannot come back
            await connect("127.0.0.1", port, secret=b"", fingerprint=FP, codecs=CODECS, timeouts=fast,
                          identity=edge, trust=trusting(auth))
