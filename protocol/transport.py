"""asyncio transport for the sans-IO connection: the only module here that does I/O.

Life cycle: `connect()` (edge) or `serve()` (core) opens a TCP (optionally TLS
or mutual-TLS) stream, runs the handshake under `handshake_timeout`, and
yields a `Peer`. A `Peer` moves bytes only: `send()` writes the frame buffers
with `writelines` and awaits `drain()` (back-pressure), `recv()` reads until
the state machine yields an event, answers Pings itself, and fails with
`PeerError` when the peer sends a connection-level Error or a read stalls past
`idle_timeout`. Any protocol violation makes this side send an Error frame
and close. A heartbeat task pings an idle link so half-open connections are
found. Servers bind 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl as ssl_module
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from protocol import messages as m
from protocol.errors import ErrorCode, ProtocolError
from protocol.state import NEED_DATA, Connection, KVData, Role, State

log = logging.getLogger("edgecore.protocol")
READ_SIZE = 1 << 18


@dataclass(frozen=True)
class Timeouts:
    handshake: float = 10.0
    idle: float = 60.0          # no bytes at all from the peer for this long → dead
    heartbeat: float = 15.0     # ping interval on an otherwise quiet link (0 = off)


class PeerError(Exception):
    """The peer closed, stalled, or reported an error; `code` says which."""

    def __init__(self, message: str, code: int = ErrorCode.PROTOCOL):
        super().__init__(message)
        self.code = code


class Peer:
    def __init__(self, conn: Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeouts: Timeouts, load_fn: Callable[[], int] | None = None):
        self.conn, self.reader, self.writer, self.timeouts = conn, reader, writer, timeouts
        self.load_fn = load_fn
        self.peer_load = 0
        self.closed = False
        self.rtt: float | None = None
        self.last_received = time.monotonic()
        self._pings: dict[int, float] = {}
        self._nonce = itertools.count(1)
        self._heartbeat: asyncio.Task | None = None

    @property
    def peername(self) -> str:
        info = self.writer.get_extra_info("peername")
        return f"{info[0]}:{info[1]}" if info else "?"

    def start_heartbeat(self) -> None:
        if self.timeouts.heartbeat > 0 and self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        with contextlib.suppress(Exception):
            while not self.closed:
                await asyncio.sleep(self.timeouts.heartbeat)
                if time.monotonic() - self.last_received > self.timeouts.idle:
                    await self.fail(f"peer silent for {self.timeouts.idle:.0f} s", ErrorCode.TIMEOUT)
                    return
                await self.ping()

    async def ping(self) -> None:
        nonce = next(self._nonce)
        self._pings[nonce] = time.monotonic()
        await self.send(m.Ping(nonce))

    async def send(self, event) -> None:
        if self.closed:
            raise PeerError("connection is closed")
        try:
            self.writer.writelines(self.conn.send(event))
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            self._abort()
            raise PeerError(f"connection lost while sending: {exc}") from None

    async def recv(self, timeout: float | None = None):
        """Next message or KVData from the peer (Ping/Pong handled here)."""
        while True:
            try:
                event = self.conn.next_event()
            except ProtocolError as exc:
                await self.fail(str(exc), exc.code)
                raise PeerError(str(exc), exc.code) from None
            if event is NEED_DATA:
                if self.closed:
                    raise PeerError("connection is closed")
                try:
                    data = await asyncio.wait_for(self.reader.read(READ_SIZE), timeout or self.timeouts.idle)
                except asyncio.TimeoutError:
                    await self.fail("timed out waiting for the peer", ErrorCode.TIMEOUT)
                    raise PeerError("timed out waiting for the peer", ErrorCode.TIMEOUT) from None
                except (ConnectionError, OSError) as exc:
                    self._abort()
                    raise PeerError(f"connection lost: {exc}") from None
                if not data:
                    self._abort()
                    raise PeerError("peer closed the connection")
                self.last_received = time.monotonic()
                try:
                    self.conn.receive_data(data)
                except ProtocolError as exc:
                    await self.fail(str(exc), exc.code)
                    raise PeerError(str(exc), exc.code) from None
                continue
            if isinstance(event, m.Ping):
                await self.send(m.Pong(event.nonce, self.load_fn() if self.load_fn else 0))
                continue
            if isinstance(event, m.Pong):
                self.peer_load = event.load
                sent = self._pings.pop(event.nonce, None)
                if sent is not None:
                    self.rtt = time.monotonic() - sent
                continue
            if isinstance(event, m.Error) and not event.request_id:
                self._abort()
                raise PeerError(f"peer error: {event.message}", event.code)
            return event

    async def fail(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        """Tell the peer why (Error frame) and close."""
        if self.closed:
            return
        with contextlib.suppress(Exception):
            self.writer.write(self.conn.error_frame(message, code))
            await asyncio.wait_for(self.writer.drain(), 1.0)
        await self.close()

    def _abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.conn.state = State.CLOSED
            self.writer.close()
            if self._heartbeat is not None:
                self._heartbeat.cancel()

    async def close(self) -> None:
        self._abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


async def _handshake_client(peer: Peer) -> None:
    conn = peer.conn
    await peer.send(conn.hello())
    welcome = await peer.recv()
    if not isinstance(welcome, m.Welcome):
        raise PeerError(f"expected Welcome, got {type(welcome).__name__}")
    await peer.send(conn.auth())
    ok = await peer.recv()
    if not isinstance(ok, m.AuthOk):
        raise PeerError(f"expected AuthOk, got {type(ok).__name__}")


async def _handshake_server(peer: Peer) -> None:
    conn = peer.conn
    hello = await peer.recv()
    if not isinstance(hello, m.Hello):
        raise PeerError(f"expected Hello, got {type(hello).__name__}")
    await peer.send(conn.welcome())
    auth = await peer.recv()
    if not isinstance(auth, m.Auth):
        raise PeerError(f"expected Auth, got {type(auth).__name__}")
    await peer.send(conn.auth_ok())


async def connect(host: str, port: int, *, secret: bytes, fingerprint: str, codecs: list[str],
                  timeouts: Timeouts = Timeouts(), ssl: ssl_module.SSLContext | None = None,
                  name: str = "edge", limits=None) -> Peer:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ssl, limit=READ_SIZE * 2), timeouts.handshake)
    except asyncio.TimeoutError:
        raise PeerError(f"connecting to {host}:{port} timed out", ErrorCode.TIMEOUT) from None
    except (ConnectionError, OSError) as exc:
        raise PeerError(f"cannot connect to {host}:{port}: {exc}") from None
    peer = Peer(Connection(Role.CLIENT, secret, fingerprint, codecs, limits, name), reader, writer, timeouts)
    try:
        await asyncio.wait_for(_handshake_client(peer), timeouts.handshake)
    except asyncio.TimeoutError:
        await peer.fail("handshake timed out", ErrorCode.TIMEOUT)
        raise PeerError(f"handshake with {host}:{port} timed out", ErrorCode.TIMEOUT) from None
    except PeerError:
        await peer.close()
        raise
    peer.start_heartbeat()
    return peer


Handler = Callable[[Peer], Awaitable[None]]


async def serve(handler: Handler, *, host: str = "127.0.0.1", port: int = 0, secret: bytes, fingerprint: str,
                codecs: list[str], timeouts: Timeouts = Timeouts(), ssl: ssl_module.SSLContext | None = None,
                name: str = "core", layout: dict | None = None, limits=None,
                load_fn: Callable[[], int] | None = None) -> asyncio.base_events.Server:
    async def on_connect(reader, writer):
        peer = Peer(Connection(Role.SERVER, secret, fingerprint, codecs, limits, name, layout), reader, writer,
                    timeouts, load_fn)
        try:
            await asyncio.wait_for(_handshake_server(peer), timeouts.handshake)
        except asyncio.TimeoutError:
            log.warning("handshake from %s timed out", peer.peername)
            await peer.fail("handshake timed out", ErrorCode.TIMEOUT)
            return
        except PeerError as exc:
            log.warning("refused %s: %s", peer.peername, exc)
            await peer.close()
            return
        peer.start_heartbeat()
        try:
            await handler(peer)
        except PeerError as exc:
            log.info("peer %s: %s", peer.peername, exc)
        finally:
            await peer.close()

    return await asyncio.start_server(on_connect, host, port, ssl=ssl, limit=READ_SIZE * 2)


def tls_context(server: bool, cert: str | None = None, key: str | None = None, ca: str | None = None,
                require_client_cert: bool = False) -> ssl_module.SSLContext:
    """TLS for WAN links; with `ca` on both sides and `require_client_cert`, mutual TLS."""
    purpose = ssl_module.Purpose.CLIENT_AUTH if server else ssl_module.Purpose.SERVER_AUTH
    ctx = ssl_module.create_default_context(purpose, cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    if server and require_client_cert:
        ctx.verify_mode = ssl_module.CERT_REQUIRED
    return ctx


__all__ = ["Peer", "PeerError", "Timeouts", "connect", "serve", "tls_context", "KVData"]
