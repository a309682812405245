"""KV streaming over loopback: edgecore protocol (raw codec) vs a plain asyncio socket.

A core-side server streams `--megabytes` of KV as KVChunk frames of `--chunk-kb`
(each frame MACed, through the sans-IO state machine and transport); the edge side
receives, verifies and decodes each chunk. The baseline sends the same bytes in
the same chunk sizes over a bare asyncio stream. Both run in this process on
one event loop (uvloop when installed), after each other, several times.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from common import emit, progress

import numpy as np

from edgecore.protocol import messages as m
from edgecore.protocol.framing import Limits
from edgecore.protocol.kv import decode_chunk, encode_chunk
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import Timeouts, connect, serve

SECRET, FP = b"bench", "b" * 64
TIMEOUTS = Timeouts(handshake=10, idle=30, heartbeat=0)


def make_chunks(total: int, chunk: int) -> list[KVData]:
    values = chunk // 4           # K and V, bf16
    rng = np.random.default_rng(0)
    k = rng.integers(0, 65535, size=values, dtype=np.uint16).reshape(1, -1, 1, 1)
    v = rng.integers(0, 65535, size=values, dtype=np.uint16).reshape(1, -1, 1, 1)
    template = encode_chunk("r", k, v, layer_start=0, token_start=0, dtype="bfloat16", codec="raw")
    return [template] * (total // chunk)


async def run_protocol(chunks: list[KVData], server_kw: dict | None = None, client_kw: dict | None = None) -> float:
    """Bytes per second of KV received and decoded at the edge side; `server_kw` / `client_kw`: more of
    `serve`'s / `connect`'s arguments (bench/link_crypto.py: sealed or not, TLS)."""
    done = asyncio.get_running_loop().create_future()

    async def core(peer):
        await peer.recv()                    # the PrefillRequest
        for c in chunks:
            # Real cores encode each chunk as it is produced; the frame MAC is computed in send().
            await peer.send(KVData(c.chunk, c.payload))
        await peer.send(m.PrefillDone("r", 1))
        await done

    limits = Limits(max_payload=64 << 20, max_buffer=80 << 20)
    server = await serve(core, secret=SECRET, fingerprint=FP, codecs=["raw"], timeouts=TIMEOUTS, limits=limits,
                         **(server_kw or {}))
    port = server.sockets[0].getsockname()[1]
    peer = await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=["raw"], timeouts=TIMEOUTS,
                         limits=limits, **(client_kw or {}))
    t = time.perf_counter()
    await peer.send(m.PrefillRequest("r", [1], codecs=["raw"]))
    received = 0
    while True:
        ev = await peer.recv()
        if isinstance(ev, m.PrefillDone):
            break
        k, v = decode_chunk(ev)
        received += k.nbytes + v.nbytes
    elapsed = time.perf_counter() - t
    done.set_result(None)
    await peer.close()
    server.close()
    await server.wait_closed()
    return received / elapsed


async def run_plain(total: int, chunk: int) -> float:
    payload = memoryview(bytes(chunk))

    async def on_conn(reader, writer):
        await reader.readexactly(1)
        for _ in range(total // chunk):
            writer.write(payload)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 19)
    t = time.perf_counter()
    writer.write(b"g")
    received = 0
    while received < (total // chunk) * chunk:
        data = await reader.read(1 << 18)
        if not data:
            break
        received += len(data)
    elapsed = time.perf_counter() - t
    writer.close()
    server.close()
    await server.wait_closed()
    return received / elapsed


async def main_async(args):
    total, chunk = args.megabytes << 20, args.chunk_kb << 10
    chunks = make_chunks(total, chunk)
    ours, plain = [], []
    for i in range(args.repeats):
        plain.append(await run_plain(total, chunk))
        ours.append(await run_protocol(chunks))
        progress(f"run {i + 1}: protocol {ours[-1] / 1e6:.0f} MB/s, plain socket {plain[-1] / 1e6:.0f} MB/s")
    o, p = statistics.median(ours), statistics.median(plain)
    emit("transport", "ratio_vs_plain_socket", round(o / p, 3), target=0.8, protocol_MBps=round(o / 1e6),
         plain_MBps=round(p / 1e6), megabytes=args.megabytes, chunk_kb=args.chunk_kb,
         loop=type(asyncio.get_running_loop()).__module__)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--megabytes", type=int, default=256)
    ap.add_argument("--chunk-kb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
