"""A userspace WAN link: a TCP relay that adds one-way delay, jitter and a bandwidth cap.

Life cycle: `WanRelay(spec).start(listen, target)` accepts connections and, for
each, opens the target and pumps both directions through a `Link`: every read
is stamped with the time its last bit would leave a link of `bandwidth_bps`
(serialization, FIFO) plus the propagation delay (± uniform jitter, never
reordering), and is written when that time comes. The bytes not yet serialized
(a router's queue) are at most `buffer_bytes`, counting what the relay's own
kernel holds unread (a capped link's socket gets a small receive buffer,
`kernel_share`, and the relay's queue the rest): beyond it the reader stops
reading, so TCP back-pressure reaches the sender; bytes being propagated take no
queue space (a link's bandwidth-delay product is not limited by its buffer). Packet loss is
not emulated here (nftables does that under `--emulate-wan`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbit: float | None = None
    buffer_bytes: int = 4 * 1024 * 1024


class Link:
    def __init__(self, spec: LinkSpec, seed: int = 0):
        self.spec = spec
        self.free_at = 0.0          # when the link finishes serializing what is queued
        self.last_release = 0.0
        self.rng = random.Random(seed)

    def release_time(self, nbytes: int, now: float) -> float:
        s = self.spec
        start = max(now, self.free_at)
        if s.bandwidth_mbit:
            self.free_at = start + nbytes * 8 / (s.bandwidth_mbit * 1e6)
        else:
            self.free_at = start
        jitter = self.rng.uniform(-s.jitter_ms, s.jitter_ms) if s.jitter_ms else 0.0
        release = self.free_at + max(0.0, s.delay_ms + jitter) / 1000
        self.last_release = max(self.last_release, release)   # keep order
        return self.last_release


class _Queue:
    """The router queue's occupancy in bytes: a read's bytes count from the read until the link has
    serialized them (they are then on the wire: the propagation delay holds no queue space)."""

    def __init__(self, limit: int):
        self.limit, self.used = max(1, limit), 0
        self._room = asyncio.Event()

    def room(self) -> int:
        return self.limit - self.used

    async def wait_room(self, least: int) -> None:
        while self.room() < min(least, self.limit):
            self._room.clear()
            await self._room.wait()

    def add(self, n: int) -> None:
        self.used += n

    def leave(self, n: int) -> None:
        self.used -= n
        self._room.set()


def kernel_share(spec: LinkSpec) -> int:
    """The receive buffer asked of a capped link's socket (SO_RCVBUF): a sixteenth of the link's buffer, 4 KiB to
    256 KiB. Linux doubles what is asked and holds up to about that much unread (measured: 64 KiB asked, 125 KB
    held), so the relay's own queue gets `buffer_bytes` less twice this: together they are the router's queue."""
    return min(256 * 1024, max(4096, spec.buffer_bytes // 16))


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    capped = link.spec.bandwidth_mbit is not None
    held = _Queue(link.spec.buffer_bytes - 2 * kernel_share(link.spec) if capped else link.spec.buffer_bytes)
    loop = asyncio.get_running_loop()

    async def feed() -> None:
        try:
            while True:
                await held.wait_room(4096)
                data = await reader.read(min(65536, held.room()))
                if not data:
                    break
                now = time.monotonic()
                held.add(len(data))
                release = link.release_time(len(data), now)
                loop.call_later(max(0.0, link.free_at - now), held.leave, len(data))
                queue.put_nowait((release, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((None, None))

    feeder = asyncio.create_task(feed())
    try:
        while True:
            at, data = await queue.get()
            if data is None:
                break
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        feeder.cancel()
        with contextlib.suppress(Exception):
            writer.close()


def _cap_receive_buffer(writer: asyncio.StreamWriter, spec: LinkSpec) -> None:
    """A capped link's bytes wait in its `buffer_bytes`, not in an autotuned kernel receive buffer in front of it
    (which would let a sender put megabytes "on the link" ahead of their time): the socket's share is small."""
    sock = writer.get_extra_info("socket")
    if spec.bandwidth_mbit and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, kernel_share(spec))


WAN_MSS = 1448     # a WAN path's TCP segment (1500-byte MTU less IP and TCP headers with timestamps)


def _wan_segments(sock: socket.socket, spec: LinkSpec) -> None:
    """A capped link's sockets take WAN-sized segments: with loopback's 64 KiB segments a receive window of a few
    KiB is less than one segment, and the sender waits for persist timers (the link stalls for seconds)."""
    if spec.bandwidth_mbit:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, WAN_MSS)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, kernel_share(spec))


async def _open(target: tuple[str, int], spec: LinkSpec) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the target whose receive side feeds the link `spec` (segment size and receive buffer set
    before the handshake, which fixes the window's scale)."""
    infos = await asyncio.get_running_loop().getaddrinfo(*target, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    _wan_segments(sock, spec)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


class WanRelay:
    def __init__(self, spec: LinkSpec, reverse: LinkSpec | None = None):
        self.spec, self.reverse = spec, reverse or spec
        self.server: asyncio.base_events.Server | None = None
        self.connections: set[asyncio.Task] = set()
        self.cut = False

    async def start(self, listen: tuple[str, int], target: tuple[str, int]) -> int:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self.cut:
                writer.close()
                return
            try:
                up_reader, up_writer = await _open(target, self.reverse)     # its reads feed the target → client link
            except OSError:
                writer.close()
                return
            _cap_receive_buffer(writer, self.spec)           # feeds the client → target link
            task = asyncio.current_task()
            assert task is not None                          # a connection callback runs in its own task
            self.connections.add(task)
            try:
                await asyncio.gather(_pump(reader, up_writer, Link(self.spec, 1)),
                                     _pump(up_reader, writer, Link(self.reverse, 2)))
            except asyncio.CancelledError:      # the link was cut
                writer.close()
                up_writer.close()
            finally:
                self.connections.discard(task)

        lsock = socket.socket(socket.AF_INET6 if ":" in listen[0] else socket.AF_INET)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _wan_segments(lsock, self.spec)
        lsock.bind(listen)
        self.server = await asyncio.start_server(on_conn, sock=lsock)
        return self.server.sockets[0].getsockname()[1]

    def cut_link(self) -> None:
        """Drop every connection and refuse new ones (a link failure)."""
        self.cut = True
        for task in list(self.connections):
            task.cancel()

    async def stop(self) -> None:
        self.cut_link()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
