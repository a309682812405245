"""A real core process (bundled model, loopback) drained with SIGTERM while edges of two protocol versions hold
requests in flight: the version-4 edge is told (Draining), the previous release's edge (versions 2 and 3) is
not and still works; both get Error SHUTTING_DOWN for new requests; /ready turns 503; every request in flight
finishes (0 failed) and the core exits 0 as soon as the last is acknowledged. The drain timeout bounds it, a
second SIGTERM cuts it short, and a drain timeout of 0 is the old immediate exit."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.error
import urllib.request

import pytest

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.transport import Peer, PeerError, connect
from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.fingerprint import model_fingerprint
from tests.conftest import MODEL_DIR
from tests.e2e.procs import Node, start_core

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PREVIOUS = (2, 3)


class Edge:
    """One edge connection that records PrefillDone / Error per request and Acks only when told."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.events: dict[str, asyncio.Future] = {}
        self.draining: list[m.Draining] = []
        self.closed = asyncio.get_running_loop().create_future()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                ev = await self.peer.recv()
                if isinstance(ev, m.Draining):
                    self.draining.append(ev)
                elif isinstance(ev, (m.PrefillDone, m.Error)) and ev.request_id in self.events:
                    fut = self.events[ev.request_id]
                    if not fut.done():
                        fut.set_result(ev)
        except PeerError as exc:
            self.closed.set_result(str(exc))

    async def send(self, rid: str, ids: list[int]) -> asyncio.Future:
        self.events[rid] = asyncio.get_running_loop().create_future()
        await self.peer.send(m.PrefillRequest(rid, ids, codecs=["raw"]))
        return self.events[rid]


def prompt(seed: int, n: int = 300) -> list[int]:
    return [(seed * 7919 + i * 31) % 2000 + 2 for i in range(n)]


def ready_status(http: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def exited(node: Node, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while node.proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return node.proc.poll()


async def edges(port: int, secret: str) -> tuple[Edge, Edge]:
    fp = model_fingerprint(MODEL_DIR, ModelConfig.from_dir(MODEL_DIR))
    new = await connect("127.0.0.1", port, secret=secret.encode(), fingerprint=fp, codecs=["raw"], name="v4")
    old = await connect("127.0.0.1", port, secret=secret.encode(), fingerprint=fp, codecs=["raw"], name="v3",
                        versions=PREVIOUS)
    assert new.conn.version == 4 and old.conn.version == 3
    return Edge(new), Edge(old)


async def in_flight(new: Edge, old: Edge, count: int = 4) -> list[tuple[Edge, str]]:
    """`count` requests per edge, each prefilled (PrefillDone) and left unacknowledged: LEASED at the core."""
    sent = [(edge, f"{edge.peer.conn.name}-{i}") for edge in (new, old) for i in range(count)]
    futures = [await edge.send(rid, prompt(seed)) for seed, (edge, rid) in enumerate(sent)]
    for fut in futures:
        assert isinstance(await asyncio.wait_for(fut, 30), m.PrefillDone)
    return sent


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text("drain-secret")
    return str(path)


async def test_sigterm_drains_requests_in_flight_from_both_versions_then_exits_0(secret):
    node, port, http = start_core(secret, "--drain-timeout", "30")
    try:
        with open(secret) as f:
            new, old = await edges(port, f.read())
        sent = await in_flight(new, old)
        assert ready_status(http) == 200
        node.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(_until(lambda: bool(new.draining)), 10)
        assert new.draining[0].timeout_ms == 30_000 and not old.draining       # only a version-4 edge is told
        assert ready_status(http) == 503
        for edge in (new, old):                                           # new work is refused, either version
            ev = await asyncio.wait_for(await edge.send(f"late-{edge.peer.conn.name}", prompt(99)), 10)
            assert isinstance(ev, m.Error) and ev.code == ErrorCode.SHUTTING_DOWN
        await asyncio.sleep(0.5)
        assert node.proc.poll() is None                                   # still serving what is in flight
        for edge, rid in sent:                                            # the edges finish their requests
            await edge.peer.send(m.Ack(rid))
        t = time.monotonic()
        assert await exited(node, 10) == 0
        assert time.monotonic() - t < 5                                   # at once, not at the drain timeout
        assert "drained in" in node.logs()
    finally:
        node.stop()


@pytest.mark.parametrize("case", ["timeout", "second SIGTERM", "timeout 0"])
async def test_the_drain_is_bounded(secret, case):
    drain = {"timeout": "1.5", "second SIGTERM": "60", "timeout 0": "0"}[case]
    node, port, _ = start_core(secret, "--drain-timeout", drain)
    try:
        with open(secret) as f:
            new, old = await edges(port, f.read())
        await in_flight(new, old, count=2)                                # never acknowledged
        t = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        if case == "second SIGTERM":
            await asyncio.wait_for(_until(lambda: bool(new.draining)), 10)
            node.proc.send_signal(signal.SIGTERM)
        assert await exited(node, 20) == 0
        took = time.monotonic() - t
        assert took < (5 if case != "timeout" else 8) and (case != "timeout" or took >= 1.4)
        for edge in (new, old):                                           # what was left fails over at the edges
            assert await asyncio.wait_for(edge.closed, 5)
        if case == "timeout 0":
            assert not new.draining and "draining" not in node.logs()
    finally:
        node.stop()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.02)
