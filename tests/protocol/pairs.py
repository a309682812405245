"""In-memory client/server pairs for sans-IO protocol tests."""

from __future__ import annotations

import numpy as np

from edgecore.protocol import messages as m
from edgecore.protocol.kv import encode_chunk
from edgecore.protocol.state import NEED_DATA, Connection, Role

SECRET = b"cluster-secret"
FP = "f" * 64
CODECS = ["raw", "lossless", "int8"]


def new_pair(secret_c=SECRET, secret_s=SECRET, fp_c=FP, fp_s=FP, limits=None, sealed=True):
    client = Connection(Role.CLIENT, secret_c, fp_c, CODECS, limits, name="edge", sealed=sealed)
    server = Connection(Role.SERVER, secret_s, fp_s, CODECS, limits, name="core", layout={"tp": 1}, sealed=sealed)
    return client, server


def forge(sender, msg, payload=b"") -> bytes:
    """A frame with a valid MAC from `sender` that its state table would not let it send (a misbehaving
    peer that knows the secret)."""
    return b"".join(sender._frame(m.tag_of(msg), m.encoder.encode(msg), memoryview(payload)))


def drain(conn):
    events = []
    while True:
        ev = conn.next_event()
        if ev is NEED_DATA:
            return events
        events.append(ev)


def deliver(data: bytes, conn, splits=None):
    """Feed `data` to `conn` in pieces (sizes from `splits`, else one piece); collect events."""
    events, pos = [], 0
    for size in (splits or [len(data)]):
        conn.receive_data(data[pos:pos + size])
        pos += size
        events += drain(conn)
    if pos < len(data):
        conn.receive_data(data[pos:])
        events += drain(conn)
    return events


def split_sizes(mode: str, n: int, rng, largest: int = 40) -> list[int]:
    """Piece sizes for feeding n bytes: "whole" (one piece), "bytewise" (one byte each) or "random" (1..largest)."""
    if mode == "whole":
        return [n]
    if mode == "bytewise":
        return [1] * n
    out: list[int] = []
    while sum(out) < n:
        out.append(rng.randint(1, largest))
    return out


def handshake(client, server):
    [hello] = deliver(client.send_bytes(client.hello()), server)
    [welcome] = deliver(server.send_bytes(server.welcome()), client)
    [auth] = deliver(client.send_bytes(client.auth()), server)
    [ok] = deliver(server.send_bytes(server.auth_ok()), client)
    return hello, welcome, auth, ok


def sample_kv(codec="lossless", tokens=20):
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((2, tokens, 2, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    v = (rng.standard_normal((2, tokens, 2, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return k, v, encode_chunk("req-1", k, v, layer_start=0, token_start=0, dtype="bfloat16", codec=codec,
                              total_tokens=tokens)


READY_CLIENT_MSGS = [
    m.PrefillRequest("req-1", [1, 2, 3], m.SamplingSpec(temperature=0.5, seed=7), ["lossless"], 5000, 0),
    m.Ack("req-1"), m.Cancel("req-1"), m.Ping(5), m.Pong(6), m.Error(10, "bad", "req-1"),
]


def ready_server_msgs():
    return [sample_kv()[2], m.PrefillDone("req-1", 42, -0.5, [(42, -0.5)], 3, 0, {"prefill_ms": 1.0}),
            m.Ping(1), m.Pong(2), m.Error(10, "too long", "req-1")]
