"""Sealed frames: the key schedule against published vectors (RFC 8448's TLS 1.3 trace, RFC 7748's X25519),
edgecore's own schedule vector (docs/wire-format.md §2a), sealing and opening (whole, in place, piecewise),
and the properties the construction is chosen for: nothing readable, fresh keys per connection, no
decryption with the cluster secret alone."""

import hashlib
import os

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from edgecore.protocol import messages as m
from edgecore.protocol.cipher import Ephemeral, FrameCipher, KeySchedule, derive_secret, hkdf_expand_label, hkdf_extract
from edgecore.protocol.errors import RemoteProtocolError
from edgecore.protocol.framing import FIXED_SIZE, SEALED, pack_fixed
from edgecore.protocol.state import KVData
from tests.protocol.pairs import deliver, handshake, new_pair, sample_kv

ALICE = "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"     # RFC 7748 §6.1
BOB = "5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"


def ephemeral(hex_private: str) -> Ephemeral:
    return Ephemeral(X25519PrivateKey.from_private_bytes(bytes.fromhex(hex_private)))


def test_hkdf_expand_label_matches_the_tls13_trace_of_rfc8448():
    early = hkdf_extract(b"", bytes(32))                          # no PSK: 32 zero bytes
    assert early.hex() == "33ad0a1c607ec03b09e6cd9893680ce210adf300aa1f2660e1b22e10f170f92a"
    derived = derive_secret(early, "derived", hashlib.sha256(b"").digest())
    assert derived.hex() == "6f2615a108c702c5678f54fc9dbab69716c076189c48250cebeac3576c3611ba"
    server_hs = bytes.fromhex("b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38")
    assert hkdf_expand_label(server_hs, "key", b"", 16).hex() == "3fce516009c21727d0f2e4e86ee403bc"
    assert hkdf_expand_label(server_hs, "iv", b"", 12).hex() == "5d313eb2671276ee13000b30"


def test_x25519_matches_rfc7748():
    alice, bob = ephemeral(ALICE), ephemeral(BOB)
    assert alice.share.hex() == "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
    assert bob.share.hex() == "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f"
    shared = alice.exchange(bob.share)
    assert shared == bob.exchange(alice.share)
    assert shared.hex() == "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"


def test_edgecore_key_schedule_vector():
    """The vector docs/wire-format.md §2a gives, for a peer written from the document."""
    shared = ephemeral(ALICE).exchange(ephemeral(BOB).share)
    schedule = KeySchedule(bytes(range(32)), shared, hashlib.sha256(b"edgecore key schedule test").digest())
    assert schedule.client_secret.hex() == "6ae69e3e9ec30c872f431d001d40bc522a7cac5efbf2f6acd7036246c8bbd3b9"
    assert schedule.server_secret.hex() == "580b092f09cff551e3a4684bf10a769591b8ec72bd4eebe1a371431189172bc6"
    key, iv = KeySchedule.traffic_keys(schedule.client_secret)
    assert (key.hex(), iv.hex()) == ("fc55dfa0c65c8fc08bc48d1f78b3e43e8fb29b21cf76490c8f35b7fcf65f3eab",
                                     "99bd18c2c509b9bd6c1e8ef2")
    key, iv = KeySchedule.traffic_keys(schedule.server_secret)
    assert (key.hex(), iv.hex()) == ("6efa61c8d5f51df3f5937711a4b7a0b49b1834c3db81c81fb89dea739d4ba046",
                                     "764f037bd73b0024d2622741")
    cipher = FrameCipher(key, iv)
    assert cipher.nonce(0) == iv and cipher.nonce(1).hex() == "764f037bd73b0024d2622740"


def test_seal_then_open_whole_and_in_place_in_pieces():
    cipher = FrameCipher(os.urandom(32), os.urandom(12))
    header, payload = b"\x93\x05\xa3abc" * 3, os.urandom(200_000)
    fixed = pack_fixed(SEALED, len(header), len(payload))
    head, body, tag = cipher.seal(9, fixed, header, memoryview(payload))
    assert head[:FIXED_SIZE] == fixed and header not in head and payload[:64] not in body
    assert cipher.open(9, memoryview(fixed), memoryview(head[FIXED_SIZE:] + body), memoryview(tag)) == header + payload
    assert cipher.open(10, memoryview(fixed), memoryview(head[FIXED_SIZE:] + body), memoryview(tag)) is None
    frame = bytearray(head + body)
    opener, view = cipher.opener(9), memoryview(frame)
    for stop in (FIXED_SIZE + 3, 70_001, len(frame)):             # as a socket would deliver it
        opener.update(view[opener.pos:stop])
        opener.pos = stop
    assert opener.verify(tag) and bytes(frame[FIXED_SIZE:]) == header + payload
    tampered = bytearray(head + body)
    tampered[-1] ^= 1
    opener = cipher.opener(9)
    opener.update(memoryview(tampered))
    assert not opener.verify(tag)


def test_a_sealed_connection_shows_nothing_of_its_messages():
    client, server = new_pair()
    handshake(client, server)
    assert client.sealed and server.sealed
    req = m.PrefillRequest("secret-request-id", list(range(1000, 1050)), m.SamplingSpec(seed=77), ["lossless"])
    wire = client.send_bytes(req)
    assert wire[5] == SEALED and b"secret-request-id" not in wire and b"lossless" not in wire
    assert deliver(wire, server) == [req]
    _, _, kv = sample_kv(tokens=2000)
    wire = server.send_bytes(kv)
    assert bytes(kv.payload[:32]) not in wire and b"req-1" not in wire
    [got] = deliver(wire, client)
    assert isinstance(got, KVData) and bytes(got.payload) == bytes(kv.payload)


def test_keys_are_fresh_per_connection_and_the_secret_alone_opens_nothing():
    """Two connections under one cluster secret seal the same message differently; a party holding the
    secret that recorded a session (its Hello, Welcome and sealed frames) but not an ephemeral private key
    cannot open its frames: it can only run its own handshake, whose keys differ."""
    frames = []
    for _ in range(2):
        client, server = new_pair()
        handshake(client, server)
        frames.append(client.send_bytes(m.Cancel("r1")))
    assert frames[0] != frames[1]
    recorder_client, recorder_server = new_pair()        # same secret, new ephemeral keys
    handshake(recorder_client, recorder_server)
    [event] = deliver(frames[0], recorder_server)
    assert type(event).__name__ == "BadFrame"             # fails its tag: not readable with the secret


def test_a_peer_without_a_key_share_or_with_a_bad_one_is_refused():
    client, server = new_pair()
    with pytest.raises(RemoteProtocolError, match="cannot encrypt"):
        deliver(client.send_bytes(m.Hello([3], os.urandom(32))), server)
    client, server = new_pair()
    with pytest.raises(RemoteProtocolError, match="key share"):
        deliver(client.send_bytes(m.Hello([3], os.urandom(32), bytes(31))), server)
    client, server = new_pair()
    with pytest.raises(RemoteProtocolError, match="not a usable X25519 key"):     # the all-zero point
        deliver(client.send_bytes(m.Hello([3], os.urandom(32), bytes(32))), server)


def rekeyed_pair(rekey, clock=None):
    from edgecore.protocol.state import Connection, Role
    from tests.protocol.pairs import CODECS, FP, SECRET
    kw = {"rekey": rekey} | ({"clock": clock} if clock else {})
    client = Connection(Role.CLIENT, SECRET, FP, CODECS, name="edge", **kw)
    server = Connection(Role.SERVER, SECRET, FP, CODECS, name="core", layout={"tp": 1}, **kw)
    handshake(client, server)
    return client, server


@pytest.mark.parametrize("mode", ["whole", "bytewise", "random"])
def test_keys_update_after_a_frame_count_without_losing_a_frame(mode):
    import random

    from edgecore.protocol.cipher import Rekey
    from tests.protocol.pairs import split_sizes
    client, server = rekeyed_pair(Rekey(frames=3))
    rng = random.Random(5)
    kv = [sample_kv(tokens=n)[2] for n in (20, 3000, 20, 5000)]      # 3000+ tokens: large frames, opened in place
    for i in range(4):
        msgs = [m.Ping(i), m.PrefillDone(f"r{i}", i), m.Pong(i)]
        data = b"".join(server.send_bytes(x) for x in msgs)
        assert deliver(data, client, split_sizes(mode, len(data), rng, 29)) == msgs
        wire = server.send_bytes(kv[i])
        [got] = deliver(wire, client, split_sizes(mode, len(wire), rng, 4099))
        assert isinstance(got, KVData) and bytes(got.payload) == bytes(kv[i].payload)
        req = m.Cancel(f"r{i}")
        assert deliver(client.send_bytes(req), server) == [req]
    assert server.key_updates >= 4 and client.key_updates == 1      # Auth and 4 Cancels: one update


def test_keys_update_after_bytes_and_after_time():
    from edgecore.protocol.cipher import Rekey
    now = [0.0]
    client, server = rekeyed_pair(Rekey(bytes=10_000, seconds=60), clock=lambda: now[0])
    kv = sample_kv(tokens=2000)[2]                                        # about 32 KB: every frame after one
    for _ in range(3):
        assert isinstance(deliver(server.send_bytes(kv), client)[0], KVData)
    assert server.key_updates == 2
    assert deliver(client.send_bytes(m.Ping(1)), server) == [m.Ping(1)] and client.key_updates == 0
    now[0] = 61.0
    assert deliver(client.send_bytes(m.Ping(2)), server) == [m.Ping(2)] and client.key_updates == 1


def test_a_flipped_key_phase_is_a_corrupted_frame_not_a_lost_key():
    import zlib

    from edgecore.protocol.cipher import Rekey
    from edgecore.protocol.state import BadFrame
    client, server = rekeyed_pair(Rekey())
    wire = bytearray(server.send_bytes(m.PrefillDone("r", 5)))
    wire[6] ^= 1                                                   # the key-phase flag, CRC made to match
    wire[16:20] = zlib.crc32(bytes(wire[:16])).to_bytes(4, "little")
    [got] = deliver(bytes(wire), client)
    assert isinstance(got, BadFrame)
    assert deliver(server.send_bytes(m.PrefillDone("r", 6)), client) == [m.PrefillDone("r", 6)]


async def test_a_kv_stream_survives_key_updates_on_both_sides_mid_transfer():
    import asyncio

    from edgecore.protocol.cipher import Rekey
    from edgecore.protocol.transport import Timeouts, connect, serve
    from tests.protocol.pairs import CODECS, FP, SECRET
    chunks = [sample_kv(tokens=1000 + 100 * i)[2] for i in range(12)]
    fast = Timeouts(handshake=2, idle=5, heartbeat=0)

    async def core(peer):
        while True:
            msg = await peer.recv()
            if isinstance(msg, m.PrefillRequest):
                for c in chunks:
                    await peer.send(c)
                await peer.send(m.PrefillDone(msg.request_id, 9))
    server = await serve(core, secret=SECRET, fingerprint=FP, codecs=CODECS, timeouts=fast, layout={"tp": 1},
                         rekey=Rekey(frames=2))
    async with server:
        peer = await connect("127.0.0.1", server.sockets[0].getsockname()[1], secret=SECRET, fingerprint=FP,
                             codecs=CODECS, timeouts=fast, rekey=Rekey(frames=1))
        for rid in ("a", "b"):
            await peer.send(m.PrefillRequest(rid, [1, 2, 3]))
            got = [await asyncio.wait_for(peer.recv(), 5) for _ in range(len(chunks) + 1)]
            assert [bytes(g.payload) for g in got[:-1]] == [bytes(c.payload) for c in chunks]
            assert got[-1] == m.PrefillDone(rid, 9)
        assert peer.conn.key_updates >= 2
        await peer.close()
