"""A core process for tests/core/test_stalled_peer.py: the bundled model, loopback, and the connection limits and
timeouts given on the command line (flags the `edgecore core` command does not have). Prints "ready PORT"."""

from __future__ import annotations

import argparse
import sys

from edgecore.core.server import CoreConfig, CoreServer
from edgecore.protocol.transport import Timeouts
from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.node.service import run_service, setup_logging
from tests.conftest import MODEL_DIR


async def stall(port: int, secret: str, requests: int) -> None:
    """The attacker: connect, send `requests` PrefillRequests of 1,000 tokens, never read; print "sent N" at the
    end and "dropped" once the core has closed the connection."""
    import asyncio
    import contextlib

    from edgecore.protocol import messages as m
    from edgecore.protocol.transport import PeerError, connect
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.models.fingerprint import model_fingerprint
    fp = model_fingerprint(MODEL_DIR, ModelConfig.from_dir(MODEL_DIR))
    peer = await connect("127.0.0.1", port, secret=secret.encode(), fingerprint=fp, codecs=["raw"])
    print("ready", flush=True)
    sent = 0
    with contextlib.suppress(PeerError):
        for i in range(requests):
            ids = [(i * 7919 + j * 31) % 2000 + 2 for j in range(1000)]
            await peer.send(m.PrefillRequest(f"s{i}", ids, codecs=["raw"]))
            sent += 1
    print(f"sent {sent}", flush=True)
    while not peer.stream.closed:
        await asyncio.sleep(0.05)
    print("dropped", flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--stall"]:
        import asyncio
        asyncio.run(stall(int(sys.argv[2]), sys.argv[3], int(sys.argv[4])))
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--secret", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--idle", type=float, default=3.0)
    p.add_argument("--max-inflight", type=int, default=16)
    p.add_argument("--max-admitted", type=int, default=None)
    p.add_argument("--outbox-mb", type=float, default=4.0)
    p.add_argument("--http", type=int, default=None)
    args = p.parse_args()
    setup_logging("[stall-core] ")
    config = CoreConfig(model_dir=str(MODEL_DIR), secret=args.secret.encode(), port=0, http_port=args.http,
                        dtype="fp32", data_dir=args.data_dir, cache=CacheConfig(block_size=16, num_blocks=2048),
                        engine=EngineConfig(max_num_batched_tokens=2048, max_num_seqs=128),
                        timeouts=Timeouts(idle=args.idle, heartbeat=1.0), max_inflight=args.max_inflight,
                        max_admitted=args.max_admitted, outbox_bytes=int(args.outbox_mb * 1024 * 1024))
    core = CoreServer(config)
    for t in core.streamer.pool.k + core.streamer.pool.v:    # the pool resident first (as a GPU's would be): RSS
        t.fill_(0)                                           # then measures what connections add

    async def start() -> None:
        await core.start()
        print(f"ready {core.port}", flush=True)

    return run_service(start, core.stop)


if __name__ == "__main__":
    sys.exit(main())
