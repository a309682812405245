"""A peer that sends many PrefillRequests and stops reading, against a real core process on the bundled model
(loopback): the core answers the requests beyond its per-connection cap OVERLOADED at once, stops copying KV
for the staller once its outbox is full, drops it within the idle timeout, its memory stays bounded, another
edge's requests meanwhile keep their latency, and the memory comes back after the staller is gone."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time

import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.transport import Peer, PeerError, connect
from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.fingerprint import model_fingerprint
from tests.conftest import MODEL_DIR
from tests.e2e.procs import Node

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

SECRET = "stall-secret"
IDLE = 6.0                       # the core's idle timeout (write deadline) in this test; at 3 s the core, busy with
# the 16-prompt warm-up, heard nothing from the well-behaved victim for 3 s on this machine and dropped it too
RSS_GROWTH_MB = 120              # what the attack may add at most (16 requests in flight, 4 MiB outbox, buffers)
RSS_BACK_MB = 40                 # how close to the pre-attack RSS the core comes back


INFLIGHT = 16                    # the core's cap on one connection's requests in flight, here


def prompt(seed: int) -> list[int]:
    """1,000 tokens, different for each seed (no prefix-cache hits between them)."""
    return [(seed * 7919 + i * 31) % 2000 + 2 for i in range(1000)]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Client:
    """A well-behaved edge connection: reads everything, Acks each PrefillDone, many requests at once."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.done: dict[str, asyncio.Future] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(PeerError):
            while True:
                ev = await self.peer.recv()
                if isinstance(ev, (m.PrefillDone, m.Error)) and ev.request_id in self.done:
                    self.done.pop(ev.request_id).set_result(ev)

    async def prefill(self, rid: str, ids: list[int]) -> float:
        """One request to PrefillDone (after all its KV) and its Ack; seconds taken."""
        start = time.perf_counter()
        self.done[rid] = asyncio.get_running_loop().create_future()
        await self.peer.send(m.PrefillRequest(rid, ids, codecs=["raw"]))
        ev = await asyncio.wait_for(self.done[rid], 30)
        if isinstance(ev, m.Error):
            raise AssertionError(f"request failed: {ev}")
        await self.peer.send(m.Ack(rid))
        return time.perf_counter() - start

    async def close(self) -> None:
        self.reader.cancel()
        await self.peer.close()


async def test_a_peer_that_stops_reading_is_bounded_dropped_and_harms_no_one():
    node = Node(["--secret", SECRET, "--data-dir", tempfile.mkdtemp(prefix="stall-core-"), "--idle", str(IDLE),
                 "--max-inflight", str(INFLIGHT), "--max-admitted", "4", "--outbox-mb", "4"],
                launcher=(sys.executable, "-m", "tests.core.stall_core"))
    port = int(node.ready_line.split()[-1])
    pid = node.proc.pid
    fp = model_fingerprint(MODEL_DIR, ModelConfig.from_dir(MODEL_DIR))

    async def dial() -> Peer:
        return await connect("127.0.0.1", port, secret=SECRET.encode(), fingerprint=fp, codecs=["raw"])
    victim = Client(await dial())
    try:
        ids = [(7 * i) % 1500 + 2 for i in range(200)]
        # Warm-up at the attack's shapes (the engine's kernels for each row count are made once and kept):
        # a well-behaved connection with as many 1000-token prompts in flight as the staller will have.
        warm = Client(await dial())
        await asyncio.gather(*(warm.prefill(f"w{j}", prompt(j + 1000)) for j in range(INFLIGHT)))
        await asyncio.gather(*(warm.prefill(f"x{j}", prompt(j + 2000)) for j in range(INFLIGHT)),
                             *(victim.prefill(f"warm{i}", ids) for i in range(3)))
        await warm.close()
        for i in range(3):
            await victim.prefill(f"warm{i}", ids)
        unloaded = statistics.median([await victim.prefill(f"u{i}", ids) for i in range(5)])
        before = rss_mb(pid)

        # The staller, a process of its own: 400 requests of 1,000 tokens, then it reads nothing.
        staller = subprocess.Popen([sys.executable, "-m", "tests.core.stall_core", "--stall", str(port), SECRET,
                                    "400"], stdout=subprocess.PIPE, text=True)
        assert staller.stdout is not None and "ready" in staller.stdout.readline()
        attacked_at, loaded, peak = time.monotonic(), [], before
        left = node.logs().count(" left: ")          # the core logs each edge connection that ends
        while node.logs().count(" left: ") == left and time.monotonic() - attacked_at < IDLE + 10:
            loaded.append(await victim.prefill(f"l{len(loaded)}", ids))
            peak = max(peak, rss_mb(pid))
        dropped_after = time.monotonic() - attacked_at
        staller.kill()
        report = staller.communicate(timeout=10)[0]
        await asyncio.sleep(1.0)
        after = rss_mb(pid)
        print(f"\nunloaded {unloaded * 1e3:.1f} ms; under attack median {statistics.median(loaded) * 1e3:.1f} ms, "
              f"max {max(loaded) * 1e3:.1f} ms over {len(loaded)} requests; staller dropped after "
              f"{dropped_after:.1f} s (staller: {report.split()}); RSS before {before:.0f} MB, peak {peak:.0f} MB, after {after:.0f} MB")
        assert dropped_after < IDLE + 5, "the core did not drop a peer that stopped reading"
        assert peak - before < RSS_GROWTH_MB
        assert statistics.median(loaded) < 2 * unloaded + 0.005
        assert after - before < RSS_BACK_MB
        assert await victim.prefill("end", ids) < 10           # the core still serves
    finally:
        await victim.close()
        node.stop()
