"""One edge→core connection: multiplexes prefill requests and routes replies.

Life cycle: `connect()` runs the handshake; a reader task then routes every
KVChunk / PrefillDone / request Error to the queue of its request. A parallel
core lists its other ranks' stream ports in its Welcome: the client opens a
connection to each (same host, same session id in the Hello) and reads KV from
them into the same queues; while all of them are up (`direct`), requests ask
every rank to send its own KV. If a link fails, every in-flight request's
queue receives the `PeerError`; the client is unhealthy until `connect()`
succeeds again. Link bandwidth is measured from the KV bytes that arrive per
transfer (EWMA). A core that announces its drain (Draining, protocol version 4)
gets no new requests on that connection at once (`healthy` is False) while its
requests in flight finish; if the connection is still open `DRAIN_GRACE` seconds
after the drain timeout it announced, it is failed here (its requests fail over
as for a dead core). A new connection (the restarted core) starts undrained. The main connection asks for the
core's prefix digests (capability "prefix-digest"): `cache` (edge/core_cache.py) holds what the core said its
prefix cache holds and its queue, fresh for each connection. The same client connects to a peer edge that serves
cached KV (edge/peer_pull.py: `server_role` "edge", `pull` sends its BlockPull and routes the answers as a
prefill's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import cast
from collections.abc import Callable
from ssl import SSLContext

from edgecore.edge.core_cache import CoreCache
from edgecore.protocol import messages as m
from edgecore.protocol.credentials import NodeIdentity, Trust
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import Peer, PeerError, Timeouts, connect
from edgecore.shared.node.env import link_sealed

log = logging.getLogger("edgecore.edge")

UNRESPONSIVE_AFTER = 5.0     # seconds a ping may go unanswered, with nothing else arriving, before placement avoids the core
DRAIN_GRACE = 5.0            # seconds past a draining core's announced timeout before the edge fails its connection


class CoreClient:
    def __init__(self, host: str, port: int, *, secret: bytes, fingerprint: str, codecs: list[str],
                 timeouts: Timeouts = Timeouts(), ssl: SSLContext | None = None, name: str = "edge",
                 identity: NodeIdentity | None = None, trust: Trust | None = None, server_role: str = "core"):
        """`identity` / `trust`: this edge's credential and the authorities it checks cores' against;
        `server_role`: the role the server's credential must have ("edge" for a peer edge)."""
        self.host, self.port, self.server_role = host, port, server_role
        self.identity, self.trust = identity, trust
        self.sealed = link_sealed()              # (EDGECORE_LINK_SEALED=0 only to measure what encryption costs)
        self.secret, self.fingerprint, self.codecs = secret, fingerprint, codecs
        self.timeouts, self.ssl, self.name = timeouts, ssl, name
        self.peer: Peer | None = None
        self.reader: asyncio.Task | None = None
        self.direct_peers: list[Peer] = []            # connections to a parallel core's other ranks
        self.direct_readers: list[asyncio.Task] = []
        self.inflight: dict[str, asyncio.Queue] = {}
        self.last_error: str | None = None
        self.bandwidth: float | None = None      # wire bytes/s while KV arrived, EWMA over transfers
        self.last_bandwidth: float | None = None  # the same for the latest transfer alone
        self.draining = False                    # the core announced its drain on the current connection
        self.cache = CoreCache()                 # what the core's digests say it holds (current connection)
        self.drain_grace = DRAIN_GRACE
        self._drain_timer: asyncio.TimerHandle | None = None
        self._failing: asyncio.Future | None = None    # failing the connection of a core whose drain overran
        self._lock = asyncio.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connected(self) -> bool:
        return self.peer is not None and not self.peer.closed

    @property
    def healthy(self) -> bool:
        """Connected and answering: a core whose pings go unanswered while nothing arrives from it for
        `UNRESPONSIVE_AFTER` seconds (stopped, wedged) gets no new requests until it answers again, instead of
        each one waiting out the transfer timeout (the connection itself is closed only after the idle timeout)."""
        if not self.connected or self.draining:
            return False
        assert self.peer is not None
        return not self.peer.unresponsive(UNRESPONSIVE_AFTER)

    def supports(self, capability: str) -> bool:
        """The connected core's AuthOk lists `capability` (protocol/messages.py, e.g. "lora")."""
        return self.peer is not None and capability in self.peer.conn.peer_capabilities

    @property
    def direct(self) -> bool:
        """Connected to every rank that streams its own KV (a parallel core), so requests may ask for it."""
        return bool(self.direct_peers) and all(not s.closed for s in self.direct_peers)

    @property
    def rtt(self) -> float:
        return self.peer.rtt if self.peer is not None and self.peer.rtt is not None else 0.05

    @property
    def load(self) -> int:
        return len(self.inflight) + (self.peer.peer_load if self.peer else 0)

    async def connect(self) -> None:
        async with self._lock:
            if self.connected:
                return
            await self._close_direct()
            try:
                self.peer = await connect(self.host, self.port, secret=self.secret, fingerprint=self.fingerprint,
                                          codecs=self.codecs, timeouts=self.timeouts, ssl=self.ssl, name=self.name,
                                          session=os.urandom(16).hex(), identity=self.identity, trust=self.trust,
                                          sealed=self.sealed, capabilities=(*m.CAPABILITIES, m.PREFIX_DIGEST),
                                          server_role=self.server_role)
            except PeerError as exc:
                self.last_error = str(exc)
                raise
            self.last_error = None
            self.cache = CoreCache()
            self._end_drain()
            self.reader = asyncio.create_task(self._read(self.peer))
            await self.peer.ping()
            await self.connect_direct()

    async def connect_direct(self) -> None:
        """(Re)open a connection to every stream port of the core, with the main connection's session."""
        await self._close_direct()
        assert self.peer is not None            # called once connected
        for port in self.peer.conn.streams:
            try:
                stream = await connect(self.host, port, secret=self.secret, fingerprint=self.fingerprint,
                                       codecs=self.codecs, timeouts=self.timeouts, ssl=self.ssl, name=self.name,
                                       session=self.peer.conn.session, identity=self.identity, trust=self.trust,
                                       sealed=self.sealed)
            except PeerError as exc:        # requests fall back to KV gathered by the core's first rank
                log.warning("core %s: stream port %d unreachable (%s); KV will come gathered", self.address,
                            port, exc)
                await self._close_direct()
                return
            self.direct_peers.append(stream)
            self.direct_readers.append(asyncio.create_task(self._read(stream)))

    async def _read(self, peer: Peer) -> None:
        try:
            while True:
                ev = await peer.recv()
                if isinstance(ev, m.Draining):
                    self._on_draining(peer, ev)
                    continue
                if isinstance(ev, m.CacheDigest):
                    if peer is self.peer:
                        self.cache.apply(ev)
                    continue
                rid = ev.chunk.request_id if isinstance(ev, KVData) else getattr(ev, "request_id", "")
                queue = self.inflight.get(rid)
                if queue is not None:
                    queue.put_nowait(ev)
        except PeerError as exc:
            self.last_error = str(exc)
            log.warning("core %s: %s", self.address, exc)
            for queue in self.inflight.values():
                queue.put_nowait(exc)
        except Exception as exc:       # a bug of ours: the requests fail over now, not at their transfer timeout
            log.exception("core %s: the connection's reader failed", self.address)
            error = PeerError(f"connection reader failed: {exc}")
            self.last_error = str(error)
            await peer.fail(str(error))
            for queue in self.inflight.values():
                queue.put_nowait(error)

    def _on_draining(self, peer: Peer, msg: m.Draining) -> None:
        """The core is stopping: nothing new goes to it; fail the connection if it outlives the drain."""
        if self.draining or peer is not self.peer:
            return
        self.draining = True
        wait = max(0.0, msg.timeout_ms / 1000) + self.drain_grace
        log.info("core %s is draining (%s): no new requests to it; %d in flight finish there (at most %.0f s)",
                 self.address, msg.message or "no reason given", len(self.inflight), wait)
        self._drain_timer = asyncio.get_running_loop().call_later(wait, self._drain_expired, peer, wait)

    def _drain_expired(self, peer: Peer, wait: float) -> None:
        self._drain_timer = None
        if peer is self.peer and not peer.closed:
            log.warning("core %s announced its drain %.0f s ago and is still connected: treating it as failed",
                        self.address, wait)
            self.last_error = "drain did not finish in time"
            task = asyncio.ensure_future(peer.fail("drain did not finish in time", ErrorCode.TIMEOUT))
            self._failing = task          # held until done

    def _end_drain(self) -> None:
        self.draining = False
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    async def prefill(self, request: m.PrefillRequest) -> asyncio.Queue:
        if not self.healthy:
            raise PeerError(f"core {self.address} is " + ("draining" if self.draining and self.connected else
                                                          "not answering" if self.connected else "not connected"))
        if request.adapter and not self.supports(m.LORA_ADAPTERS):   # it would drop the adapter: base weights
            raise PeerError(f"core {self.address} does not serve LoRA adapters")
        return await self._ask(request)

    async def pull(self, request: m.BlockPull) -> asyncio.Queue:
        """Ask a peer edge for cached blocks: the queue receives their KVData, then BlockPullDone (or an Error,
        a PeerError)."""
        if not self.healthy or not self.supports(m.BLOCK_PULL):
            raise PeerError(f"peer {self.address} does not serve cached KV now")
        return await self._ask(request)

    async def _ask(self, request: m.PrefillRequest | m.BlockPull) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.inflight[request.request_id] = queue
        assert self.peer is not None            # healthy
        try:
            await self.peer.send(request)
        except PeerError:
            self.inflight.pop(request.request_id, None)
            raise
        return queue

    def finish(self, request_id: str, wire_bytes: int = 0, seconds: float = 0.0) -> None:
        self.inflight.pop(request_id, None)
        if wire_bytes > 1 << 18 and seconds > 0.005:
            rate = wire_bytes / seconds
            self.last_bandwidth = rate
            self.bandwidth = rate if self.bandwidth is None else 0.7 * self.bandwidth + 0.3 * rate

    async def send(self, msg: m.Message) -> None:
        if self.connected:
            assert self.peer is not None
            with contextlib.suppress(PeerError):
                await self.peer.send(msg)

    async def _close_direct(self) -> None:
        for task in self.direct_readers:
            task.cancel()
        for peer in self.direct_peers:
            await peer.close()
        self.direct_peers, self.direct_readers = [], []

    async def close(self) -> None:
        self._end_drain()
        await self._close_direct()
        if self.peer is not None:
            await self.peer.close()
        if self.reader is not None:
            self.reader.cancel()


class CoreRouter:
    """The configured cores, health-checked (which of them takes a request: edge/core_choice.py).

    Cores come from static addresses and/or DNS names (e.g. a headless Service):
    each name is resolved at start and on every health check, and every address
    it yields becomes a core (`make_client` builds the connection).
    """

    def __init__(self, clients: list[CoreClient], check_interval: float = 2.0,
                 dns: list[tuple[str, int]] | None = None,
                 make_client: Callable[[str, int], CoreClient] | None = None):
        self.clients = clients
        self.check_interval = check_interval
        self.dns = dns or []
        self.make_client = make_client
        self._task: asyncio.Task | None = None

    async def _resolve(self) -> None:
        loop = asyncio.get_running_loop()
        known = {c.address for c in self.clients}
        for host, port in self.dns:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("cannot resolve core name %s: %s", host, exc)
                continue
            for info in infos:
                ip = cast(str, info[4][0])      # an IPv4/IPv6 address (typeshed also allows a raw (int, bytes) form)
                if f"{ip}:{port}" not in known:
                    assert self.make_client is not None, "a core name needs make_client"
                    self.clients.append(self.make_client(ip, port))
                    known.add(f"{ip}:{port}")

    async def start(self) -> None:
        await self._resolve()
        await asyncio.gather(*(self._try_connect(c) for c in self.clients))
        self._task = asyncio.create_task(self._health_loop())

    async def _try_connect(self, client: CoreClient) -> None:
        with contextlib.suppress(PeerError):
            await client.connect()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            await self._resolve()
            for client in self.clients:
                if client.connected:
                    assert client.peer is not None
                    with contextlib.suppress(PeerError):
                        await client.peer.ping()
                    if client.peer.conn.streams and not client.direct:     # a stream connection dropped
                        await client.connect_direct()
                else:
                    await self._try_connect(client)

    def healthy(self, needs: str | None = None) -> list[CoreClient]:
        """Healthy cores; with `needs`, only those that advertise that capability (e.g. "lora")."""
        return [c for c in self.clients if c.healthy and (needs is None or c.supports(needs))]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for client in self.clients:
            await client.close()
