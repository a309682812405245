"""The edge's side of a core's drain (edge/core_client.py), against a scripted core on loopback (no model): on
Draining the core gets no new requests at once (unhealthy, not picked) while requests in flight keep their
queue; a core that stays connected past its announced timeout (plus the grace) is failed here, so its requests
fail over; the next connection (the restarted core) starts undrained."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from edgecore.edge.core_client import CoreClient, CoreRouter
from edgecore.protocol import messages as m
from edgecore.protocol.transport import Peer, PeerError, serve

pytestmark = pytest.mark.timeout(30)

SECRET, FP, CODECS = b"drain-secret", "d" * 64, ["raw"]


async def scripted_core(drain_ms: int | None):
    """A core whose first connection announces a drain of `drain_ms` (None: never) and then never closes."""
    connections: list[Peer] = []

    async def handler(peer: Peer) -> None:
        connections.append(peer)
        if drain_ms is not None and len(connections) == 1:
            await peer.send(m.Draining(drain_ms, "test drain"))
        with contextlib.suppress(PeerError):
            while True:
                await peer.recv()
    server = await serve(handler, secret=SECRET, fingerprint=FP, codecs=CODECS)
    return server, server.sockets[0].getsockname()[1], connections


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_a_draining_core_gets_nothing_new_and_is_failed_after_its_timeout():
    server, port, _ = await scripted_core(drain_ms=300)
    client = CoreClient("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS)
    client.drain_grace = 0.2
    router = CoreRouter([client], check_interval=60)
    try:
        await client.connect()
        inflight: asyncio.Queue = asyncio.Queue()
        client.inflight["in-flight"] = inflight            # a request sent before the drain
        await until(lambda: client.draining)
        assert client.connected and not client.healthy and router.healthy() == []
        with pytest.raises(PeerError, match="draining"):
            await client.prefill(m.PrefillRequest("new", [1, 2, 3], codecs=CODECS))
        assert inflight.empty()                              # still in flight: the core may finish it
        started = asyncio.get_running_loop().time()
        event = await asyncio.wait_for(inflight.get(), 5)    # never disconnected: failed after 0.3 + 0.2 s
        took = asyncio.get_running_loop().time() - started
        assert isinstance(event, PeerError) and 0.2 < took < 3
        assert not client.connected
        # the restarted core (a new connection) is healthy and undrained
        await client.connect()
        assert client.healthy and not client.draining and router.healthy() == [client]
    finally:
        await client.close()
        server.close()


async def test_a_core_that_does_not_drain_stays_healthy():
    server, port, connections = await scripted_core(drain_ms=None)
    client = CoreClient("127.0.0.1", port, secret=SECRET, fingerprint=FP, codecs=CODECS)
    try:
        await client.connect()
        await until(lambda: bool(connections))
        await asyncio.sleep(0.3)
        assert client.healthy and not client.draining
    finally:
        await client.close()
        server.close()
