"""asyncio transport for the sans-IO connection: the only module here that does I/O.

Life cycle: `connect()` (edge) or `serve()` (core) opens a TCP (optionally TLS or mutual-TLS) stream, runs the
handshake under `handshake_timeout`, and yields a `Peer`. A `Peer` moves bytes only: `send()` writes the frame
buffers with `writelines` and awaits `drain()` (back-pressure) for at most `idle_timeout` (a peer that stops
reading is dropped, its buffers with it), `recv()` reads until the state machine yields an event, answers Pings
itself (the Pong carries this side's received-byte count, for the peer's pacer), and fails with `PeerError` when
the peer sends a connection-level Error or a read stalls past `idle_timeout`. Received bytes go straight from the
socket into the frame parser's buffer (an asyncio BufferedProtocol), so a large KV payload is received in place
and never copied again. Any protocol violation makes this side send an Error frame and close. A frame that fails
its MAC in READY is answered with `Reject` (not surfaced); a `Reject` from the peer is resolved by
`FrameRejected.recovery()`: resend, tell the peer which request failed, or hand this side an Error for just that
request (events.py). A heartbeat task pings an idle link so half-open connections are found. Servers bind
127.0.0.1 unless told otherwise. The transport uses only the Connection's methods, never its parser or state.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl as ssl_module
import sys
import time
import typing
from collections import deque
from dataclasses import dataclass
from collections.abc import Awaitable, Callable

from edgecore.protocol import messages as m
from edgecore.protocol.cipher import Rekey
from edgecore.protocol.credentials import NodeIdentity, Trust
from edgecore.protocol.errors import ErrorCode, ProtocolError
from edgecore.protocol.events import BadFrame, FrameRejected, _NeedData
from edgecore.protocol.framing import Limits
from edgecore.protocol.state import Connection, KVData, Role

log = logging.getLogger("edgecore.protocol")

_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None


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


class _Stream(asyncio.BufferedProtocol):
    """The connection's socket side: the kernel writes received bytes straight into the frame
    parser's buffer; writes go to the transport, with pause/resume for back-pressure."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.transport: asyncio.Transport          # set by connection_made
        self.closed = False
        self.error: Exception | None = None
        self.protocol_error: ProtocolError | None = None
        self._data = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.paused = False
        self.on_connect: Callable[[_Stream], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)     # a stream's transport
        if self.on_connect is not None:
            self.on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        try:
            return self.conn.get_buffer()
        except ProtocolError as exc:       # a bad fixed header: stop reading, let recv report it
            self.protocol_error = exc
            self.transport.pause_reading()
            self._data.set()
            return memoryview(bytearray(16))

    def buffer_updated(self, nbytes: int) -> None:
        if self.protocol_error is None:
            try:
                self.conn.buffer_updated(nbytes)
                if self.conn.full:              # back-pressure until the frame is taken
                    self.transport.pause_reading()
                    self.paused = True
            except ProtocolError as exc:
                self.protocol_error = exc
                self.transport.pause_reading()
        self._data.set()

    def taken(self) -> None:
        """A frame was consumed: receive again if reading was paused for it. Asking whether the buffer is
        full parses the next frame's fixed header: a bad one is kept for `recv` to report (Error frame, close),
        as in `buffer_updated`."""
        try:
            full = self.conn.full
        except ProtocolError as exc:
            self.protocol_error = exc
            self.transport.pause_reading()
            return
        if self.paused and not full and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        self.closed = True
        self._data.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._data.set()
        self._can_write.set()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def wait_data(self) -> None:
        await self._data.wait()
        self._data.clear()

    @property
    def writable(self) -> bool:
        """The transport's buffer is below its high-water mark: a drain would not wait."""
        return self._can_write.is_set()

    async def drain(self) -> None:
        await self._can_write.wait()
        if self.closed and self.error is not None:
            raise ConnectionResetError(str(self.error))


class Peer:
    def __init__(self, conn: Connection, stream: _Stream, timeouts: Timeouts,
                 load_fn: Callable[[], int] | None = None):
        self.conn, self.stream, self.timeouts = conn, stream, timeouts
        self.transport = stream.transport
        self.load_fn = load_fn
        self.peer_load = 0
        self.closed = False
        self.rtt: float | None = None
        self.last_received = time.monotonic()
        self._pings: dict[int, float] = {}
        self._marks: dict[int, int] = {}         # a ping's nonce: `written` right after it
        self.written = 0                         # bytes written on the connection by this Peer
        self._write_log: deque[tuple[float, int]] | None = None
        # (arrival, the Ping's send time, `written` after it or None, Pong) for a Pong with a byte count (core/pacer.py)
        self.on_report: Callable[[float, float, int | None, m.Pong], None] | None = None
        self._nonce = itertools.count(1)
        self._heartbeat: asyncio.Task | None = None
        self._unguard: Callable[[], None] | None = None      # stops the revocation watch of this connection

    @property
    def peername(self) -> str:
        info = self.transport.get_extra_info("peername")
        return f"{info[0]}:{info[1]}" if info else "?"

    def guard(self, trust: Trust | None) -> None:
        """Close this connection if the peer's credential is revoked while it lives (checked as the
        revocation file changes, `Trust.watch`)."""
        cred = self.conn.peer_credential
        if trust is None or cred is None:
            return
        def revoked(serial: str) -> None:
            log.warning("closing %s: its credential %s (%s) was revoked", self.peername, serial, cred.name)
            asyncio.get_running_loop().create_task(self.fail(f"credential {serial} revoked", ErrorCode.AUTH_FAILED))
        self._unguard = trust.track(cred.serial, revoked)

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

    def unresponsive(self, after: float) -> bool:
        """A ping has waited more than `after` seconds for its Pong and nothing at all came meanwhile (a stopped
        or wedged peer). A Pong queued behind a long transfer on a slow link does not count: bytes arrive."""
        if not self._pings:
            return False
        now = time.monotonic()
        return now - min(self._pings.values()) > after and now - self.last_received > after

    async def ping(self, pad: int = 0) -> None:
        nonce = next(self._nonce)
        self._pings[nonce] = time.monotonic()
        await self.send(m.Ping(nonce, bytes(pad)), mark=nonce)

    # ---- the write path's bounds (a KV-carrying connection keeps what waits below the outbox small) ----------
    def limit_write_buffer(self, high: int) -> None:
        """Cap the asyncio transport's write buffer: `send` waits (drain) once more than `high` bytes are
        buffered, so a latency-critical frame written next waits behind at most about `high` bytes here."""
        with contextlib.suppress(Exception):
            self.transport.set_write_buffer_limits(high=high, low=high // 4)

    def log_writes(self) -> deque[tuple[float, int]]:
        """From now on, keep (time, `written`) after every write (bounded, the newest last)."""
        if self._write_log is None:
            self._write_log = deque(maxlen=4096)
        return self._write_log

    def _tcp_info(self) -> bytes | None:
        sock = self.transport.get_extra_info("socket")
        if _TCP_INFO is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            return sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 160)
        except OSError:
            return None

    def received_bytes(self) -> int:
        """Bytes this side's kernel has received here, read or not (TCP_INFO `tcpi_bytes_received`; 0: unknown)."""
        info = self._tcp_info()
        if info is None or len(info) < 136:
            return 0
        return int.from_bytes(info[128:136], sys.byteorder)

    def unsent(self) -> int:
        """Bytes written by this side but not yet sent by the kernel: the transport's buffer plus the socket's
        not-sent backlog (TCP_INFO `tcpi_notsent_bytes`, Linux; elsewhere the transport's buffer only)."""
        pending = self.transport.get_write_buffer_size()
        info = self._tcp_info()
        if info is not None and len(info) >= 148:
            pending += int.from_bytes(info[144:148], sys.byteorder)
        return pending

    async def probe(self) -> int:
        """Send a Ping now (its nonce): `answered(nonce)` then gives the round trip once the Pong is in."""
        nonce = next(self._nonce)
        self._pings[nonce] = time.monotonic()
        await self.send(m.Ping(nonce), mark=nonce)
        return nonce

    def answered(self, nonce: int) -> float | None:
        """The round trip of the probe `nonce` once its Pong came (None while it is outstanding)."""
        return None if nonce in self._pings else self.rtt

    async def send(self, event: m.Message | KVData, mark: int = 0) -> None:
        """Write one event (`mark`: a ping's nonce, whose `written` after it is remembered), then wait for room."""
        if self.closed or self.stream.closed or not self.conn.usable:
            raise PeerError("connection is closed")
        try:
            bufs = self.conn.send(event)
            self.transport.writelines(bufs)
            self.written += sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in bufs)
            if self._write_log is not None:
                self._write_log.append((time.monotonic(), self.written))
            if mark:
                self._marks[mark] = self.written
            # A deadline on every drain: a peer that stops reading while it keeps sending (or pinging) must not
            # hold this side's sender, its Pong or its heartbeat for ever. Bytes leaving restart the wait (each
            # drain returns once the buffer is below its low-water mark), so a slow link is not a stalled one.
            if self.stream.writable:     # the common case, without a timer
                await self.stream.drain()
            else:
                await asyncio.wait_for(self.stream.drain(), self.timeouts.idle)
        except TimeoutError:
            self._abort(hard=True)
            raise PeerError(f"peer stopped reading: nothing could be sent for {self.timeouts.idle:.0f} s",
                            ErrorCode.TIMEOUT) from None
        except (ConnectionError, OSError, RuntimeError) as exc:
            self._abort()
            raise PeerError(f"connection lost while sending: {exc}") from None

    async def recv(self, timeout: float | None = None) -> m.Message | KVData:
        """Next message or KVData from the peer (Ping/Pong handled here)."""
        while True:
            try:
                if self.stream.protocol_error is not None:
                    raise self.stream.protocol_error
                event = self.conn.next_event()
            except ProtocolError as exc:
                await self.fail(str(exc), exc.code)
                raise PeerError(str(exc), exc.code) from None
            if isinstance(event, _NeedData):       # NEED_DATA, its only instance
                if self.closed:
                    raise PeerError("connection is closed")
                if self.stream.closed:
                    self._abort()
                    if self.stream.error is not None:
                        raise PeerError(f"connection lost: {self.stream.error}")
                    raise PeerError("peer closed the connection")
                try:
                    await asyncio.wait_for(self.stream.wait_data(), timeout or self.timeouts.idle)
                except TimeoutError:
                    await self.fail("timed out waiting for the peer", ErrorCode.TIMEOUT)
                    raise PeerError("timed out waiting for the peer", ErrorCode.TIMEOUT) from None
                self.last_received = time.monotonic()
                continue
            self.stream.taken()
            if isinstance(event, m.Ping):
                received, at_us = self.received_bytes(), time.monotonic_ns() // 1000
                await self.send(m.Pong(event.nonce, self.load_fn() if self.load_fn else 0, received, at_us * (received > 0)))
                continue
            if isinstance(event, m.Pong):
                self.peer_load = event.load
                sent = self._pings.pop(event.nonce, None)
                mark = self._marks.pop(event.nonce, None)
                if sent is not None:
                    now = time.monotonic()
                    self.rtt = now - sent
                    if self.on_report is not None and event.at_us:
                        self.on_report(now, sent, mark, event)
                continue
            if isinstance(event, BadFrame):
                await self.send(event.reject())
                continue
            if isinstance(event, FrameRejected):
                recovery = event.recovery()
                for msg in recovery.send:
                    await self.send(msg)
                if recovery.deliver is None:
                    continue
                event = recovery.deliver
            if isinstance(event, m.Error) and not event.request_id:
                self._abort()
                raise PeerError(f"peer error: {event.message}", event.code)
            return event

    async def fail(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        """Tell the peer why (Error frame) and close."""
        if self.closed:
            return
        flushed = False
        with contextlib.suppress(Exception):
            self.transport.write(self.conn.error_frame(message, code))
            await asyncio.wait_for(self.stream.drain(), 1.0)
            flushed = True
        self._abort(hard=not flushed)

    def _abort(self, hard: bool = False) -> None:
        """Close; `hard`: drop what is still buffered for the peer (it stopped reading, so a graceful close
        would keep the socket and its buffers until it reads again)."""
        if not self.closed:
            self.closed = True
            self.conn.close()
            if hard:
                self.transport.abort()
            else:
                self.transport.close()
            if self._heartbeat is not None:
                self._heartbeat.cancel()
            if self._unguard is not None:
                self._unguard()

    async def close(self) -> None:
        self._abort()


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
                  name: str = "edge", limits: Limits | None = None, session: str = "", sealed: bool = True,
                  rekey: Rekey = Rekey(), identity: NodeIdentity | None = None, trust: Trust | None = None,
                  versions: tuple[int, ...] | None = None, capabilities: tuple[str, ...] | None = None,
                  server_role: str = "core") -> Peer:
    """`sealed`: encrypt the link (the default; False only to measure against authenticated-only frames);
    `rekey`: when this side updates its sending key; `identity` / `trust`: this node's credential and the
    authorities and revocations it checks the core's against (credentials.py); `versions`: the protocol
    versions offered (default: all this release speaks); `capabilities`: what the Auth lists (default
    messages.CAPABILITIES); `server_role`: the role the server's credential must have ("edge": a peer edge)."""
    conn = Connection(Role.CLIENT, secret, fingerprint, codecs, limits, name, session=session, sealed=sealed,
                      rekey=rekey, identity=identity, trust=trust, versions=versions,
                      capabilities=None if capabilities is None else list(capabilities), server_role=server_role)
    loop = asyncio.get_running_loop()
    try:
        _, stream = await asyncio.wait_for(loop.create_connection(lambda: _Stream(conn), host, port, ssl=ssl),
                                           timeouts.handshake)
    except TimeoutError:
        raise PeerError(f"connecting to {host}:{port} timed out", ErrorCode.TIMEOUT) from None
    except (ConnectionError, OSError) as exc:
        raise PeerError(f"cannot connect to {host}:{port}: {exc}") from None
    peer = Peer(conn, stream, timeouts)
    try:
        await asyncio.wait_for(_handshake_client(peer), timeouts.handshake)
    except TimeoutError:
        await peer.fail("handshake timed out", ErrorCode.TIMEOUT)
        raise PeerError(f"handshake with {host}:{port} timed out", ErrorCode.TIMEOUT) from None
    except PeerError:
        await peer.close()
        raise
    peer.start_heartbeat()
    peer.guard(trust)
    return peer


Handler = Callable[[Peer], Awaitable[None]]


async def serve(handler: Handler, *, host: str = "127.0.0.1", port: int = 0, secret: bytes, fingerprint: str,
                codecs: list[str], timeouts: Timeouts = Timeouts(), ssl: ssl_module.SSLContext | None = None,
                name: str = "core", layout: dict[str, int] | None = None, limits: Limits | None = None,
                load_fn: Callable[[], int] | None = None, streams: list[int] | None = None, sealed: bool = True,
                rekey: Rekey = Rekey(), identity: NodeIdentity | None = None, trust: Trust | None = None,
                versions: tuple[int, ...] | None = None, capabilities: tuple[str, ...] | None = None
                ) -> asyncio.base_events.Server:
    async def on_connect(stream: _Stream) -> None:
        peer = Peer(stream.conn, stream, timeouts, load_fn)
        try:
            await asyncio.wait_for(_handshake_server(peer), timeouts.handshake)
        except TimeoutError:
            log.warning("handshake from %s timed out", peer.peername)
            await peer.fail("handshake timed out", ErrorCode.TIMEOUT)
            return
        except PeerError as exc:
            log.warning("refused %s: %s", peer.peername, exc)
            await peer.close()
            return
        except Exception:               # a bug of ours: the peer still gets an Error frame and a closed socket
            log.exception("handshake from %s failed", peer.peername)
            await peer.fail("internal error during the handshake", ErrorCode.INTERNAL)
            return
        peer.start_heartbeat()
        peer.guard(trust)
        try:
            await handler(peer)
        except PeerError as exc:
            log.info("peer %s: %s", peer.peername, exc)
        except Exception:
            log.exception("serving %s failed", peer.peername)
            await peer.fail("internal error", ErrorCode.INTERNAL)
        finally:
            await peer.close()

    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    def factory() -> _Stream:
        stream = _Stream(Connection(Role.SERVER, secret, fingerprint, codecs, limits, name, layout,
                                    streams=streams, sealed=sealed, rekey=rekey, identity=identity, trust=trust,
                                    versions=versions, capabilities=None if capabilities is None else list(capabilities)))

        def started(s: _Stream) -> None:
            task = loop.create_task(on_connect(s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        stream.on_connect = started
        return stream

    return await loop.create_server(factory, host, port, ssl=ssl)


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


__all__ = ["Peer", "PeerError", "Rekey", "Timeouts", "connect", "serve", "tls_context", "KVData"]
