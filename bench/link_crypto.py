"""What encrypting the core↔edge link costs, and why sealed frames rather than TLS: KV streamed over loopback
(`--megabytes` as KVChunk frames of `--chunk-kb`, received, verified and decoded as an edge does) through
1. sealed frames (the default: AES-256-GCM per frame, keys from X25519 + the cluster secret, cipher.py),
2. authenticated-only frames (earlier releases: GMAC, nothing encrypted) — the baseline,
3. TLS 1.3 (stdlib ssl, mutual authentication, ECDSA P-256 certificates) carrying authenticated-only frames;
and the CPU time of one connection's handshake (both sides, in this process) for sealed frames and for mutual
TLS 1.3 with its certificate checks. All in one run, several repeats each; the metric is sealed over
authenticated-only throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import statistics
import tempfile
import time
from pathlib import Path

from common import emit, progress
from transport import TIMEOUTS, make_chunks, run_protocol

from edgecore.deploy.certs import LocalCA
from edgecore.protocol.framing import Limits
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import connect, serve, tls_context

SECRET, FP = b"bench", "b" * 64
LIMITS = Limits(max_payload=64 << 20, max_buffer=80 << 20)


def make_tls(folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for mutual TLS 1.3 under a fresh CA, as `tls_context` builds them."""
    ca = LocalCA.create(folder / "ca")
    core_cert, core_key = ca.issue("core", ["127.0.0.1", "localhost"], folder)
    edge_cert, edge_key = ca.issue("edge", ["edge"], folder)
    server = tls_context(True, core_cert, core_key, ca.ca_file, True)
    client = tls_context(False, edge_cert, edge_key, ca.ca_file)
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return server, client


async def stream(chunks: list[KVData], sealed: bool, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None) -> float:
    """Bytes per second of KV received and decoded at the edge side (bench/transport.py's stream)."""
    return await run_protocol(chunks, {"sealed": sealed, "ssl": tls[0] if tls else None},
                              {"sealed": sealed, "ssl": tls[1] if tls else None})


async def handshake_cpu(sealed: bool, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None, n: int) -> float:
    """CPU milliseconds per connection (both sides' handshakes, this process) over `n` connections."""
    async def idle(peer):
        await asyncio.sleep(0)

    server = await serve(idle, secret=SECRET, fingerprint=FP, codecs=["raw"], timeouts=TIMEOUTS, sealed=sealed,
                         ssl=tls[0] if tls else None)
    port = server.sockets[0].getsockname()[1]
    cpu = time.process_time()
    for _ in range(n):
        peer = await connect("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=["raw"], timeouts=TIMEOUTS,
                             sealed=sealed, ssl=tls[1] if tls else None)
        await peer.close()
    spent = time.process_time() - cpu
    server.close()
    await server.wait_closed()
    return spent / n * 1e3


async def main_async(args: argparse.Namespace) -> None:
    chunks = make_chunks(args.megabytes << 20, args.chunk_kb << 10)
    with tempfile.TemporaryDirectory() as folder:
        tls = make_tls(Path(folder))
        modes = {"sealed": (True, None), "authenticated_only": (False, None), "tls13_mutual": (False, tls)}
        runs: dict[str, list[float]] = {name: [] for name in modes}
        for i in range(args.repeats):
            for name, (sealed, ctx) in modes.items():
                runs[name].append(await stream(chunks, sealed, ctx))
            progress(f"run {i + 1}: " + ", ".join(f"{k} {v[-1] / 1e6:.0f} MB/s" for k, v in runs.items()))
        mbps = {name: round(statistics.median(v) / 1e6) for name, v in runs.items()}
        handshake = {"sealed": await handshake_cpu(True, None, args.handshakes),
                     "authenticated_only": await handshake_cpu(False, None, args.handshakes),
                     "tls13_mutual": await handshake_cpu(False, tls, args.handshakes)}
    progress("handshake CPU per connection (both sides): " + ", ".join(f"{k} {v:.2f} ms"
                                                                         for k, v in handshake.items()))
    emit("link_crypto", "sealed_vs_authenticated_only", round(mbps["sealed"] / mbps["authenticated_only"], 3),
         MBps=mbps, handshake_cpu_ms={k: round(v, 2) for k, v in handshake.items()}, megabytes=args.megabytes,
         chunk_kb=args.chunk_kb, repeats=args.repeats, loop=type(asyncio.get_running_loop()).__module__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--megabytes", type=int, default=256, help="KV streamed per run")
    ap.add_argument("--chunk-kb", type=int, default=1024, help="KV frame size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--handshakes", type=int, default=100, help="connections timed for the handshake CPU")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
