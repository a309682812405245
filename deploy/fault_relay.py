"""A fault-injecting TCP relay for the edge ↔ core protocol, driven by a seeded plan.

Life cycle: `FaultRelay(target).start(listen)` accepts connections and, for each, opens the target
and pumps both directions frame by frame: a `FrameSplitter` (sans-IO) cuts the byte stream at frame
boundaries read from each frame's fixed header. `arm(fault)` schedules one `Fault`: on the first
connection that reaches the fault's frame (direction, frame type, n-th such frame) the relay drops,
delays, duplicates, reorders, truncates, bit-flips (in the header or the payload) that frame, or
closes the connection there (frames are counted from the arming); everything else passes unchanged. `fired` then holds when the fault
happened, and later connections (reconnects) pass clean until the next `arm`. A relay made with a
`plan` instead asks it about every frame (direction, frame type, how many frames of that type this
connection has carried that way, this one included, the frame's bytes) and applies the fault it returns,
as often as it returns one; `log` and `frames` record what was done and seen. `RelayThread` runs a relay
on its own event loop, for callers that drive real processes synchronously.

The relay only parses the lengths of the original frames, so a flipped length reaches the receiver
exactly as a corrupted frame would, and the relay keeps its own framing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable

from edgecore.protocol.framing import FIXED_SIZE, PREFIX, TAG_SIZE

KINDS = ("drop", "delay", "duplicate", "reorder", "truncate", "flip_header", "flip_message", "flip_payload",
         "close")




@dataclass(frozen=True)
class Fault:
    kind: str                  # one of KINDS
    direction: str             # "up" (edge → core) or "down" (core → edge)
    frame_type: int | None     # only frames of this type count (None: every frame)
    nth: int                   # the n-th counted frame on the connection (0 = first)
    bit: int = 0               # for flips: the bit to flip, modulo the region's size in bits
    delay_s: float = 0.5
    position: float | None = None   # for flips: where in the region, 0..1 (overrides bit)

    @staticmethod
    def random(rng: random.Random, frame_types: dict[str, list[int | None]]) -> Fault:
        """A fault drawn from rng: frame_types maps a direction to the frame types worth hitting."""
        direction = rng.choice(sorted(frame_types))
        ftype = rng.choice(frame_types[direction])
        return Fault(rng.choice(KINDS), direction, ftype, rng.randrange(3 if ftype is not None else 8),
                     rng.randrange(1 << 30), rng.uniform(0.05, 1.5))


class FrameSplitter:
    """Sans-IO: feed bytes, take whole frames (fixed header + message header + payload + MAC tag)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """Complete frames as (frame type, offset of the payload, frame bytes)."""
        self.buf += data
        frames = []
        while len(self.buf) >= FIXED_SIZE:
            _magic, _version, ftype, _flags, hlen, plen = PREFIX.unpack_from(self.buf)
            size = FIXED_SIZE + hlen + plen + TAG_SIZE
            if len(self.buf) < size:
                break
            frames.append((ftype, FIXED_SIZE + hlen, bytes(self.buf[:size])))
            del self.buf[:size]
        return frames


def flip(frame: bytes, start: int, end: int, bit: int, position: float | None = None) -> bytes:
    """frame with one bit flipped inside [start, end) (the whole frame if that range is empty): the
    bit-th bit (modulo the range), or the bit at `position` (0..1) of the range."""
    if end <= start:
        start, end = 0, len(frame)
    bits = (end - start) * 8
    pos = start * 8 + (min(bits - 1, int(position * bits)) if position is not None else bit % bits)
    out = bytearray(frame)
    out[pos // 8] ^= 1 << (pos % 8)
    return bytes(out)


# plan(direction, frame type, count of such frames on this connection that way (from 1), frame) → a fault or None
Plan = Callable[[str, int, int, bytes], "Fault | None"]


class FaultRelay:
    def __init__(self, target: tuple[str, int], plan: Plan | None = None):
        self.target, self.plan = target, plan
        self.log: list[tuple[str, int, Fault]] = []            # (direction, frame type, fault) as applied
        self.frames: collections.Counter = collections.Counter()   # (direction, frame type) → frames seen
        self.fault: Fault | None = None
        self.fired: float | None = None           # monotonic time the armed fault happened
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task] = set()
        self.epoch = 0

    def arm(self, fault: Fault | None) -> None:
        self.fault, self.fired = fault, None
        self.epoch += 1                            # connections count frames afresh from here

    async def start(self, listen: tuple[str, int]) -> int:
        self.server = await asyncio.start_server(self._on_client, *listen)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        conn = _Connection(self, writer, up_writer)
        pumps = [asyncio.create_task(conn.pump(reader, up_writer, "up")),
                 asyncio.create_task(conn.pump(up_reader, writer, "down"))]
        self.tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        conn.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        self.tasks.difference_update(pumps)


class _Connection:
    """One relayed connection: frame counters per direction and the pending reordered frame."""

    def __init__(self, relay: FaultRelay, client: asyncio.StreamWriter, server: asyncio.StreamWriter):
        self.relay, self.writers = relay, (client, server)
        self.counts = {"up": 0, "down": 0}
        self.per_type: collections.Counter = collections.Counter()
        self.epoch = relay.epoch
        self.held: dict[str, bytes] = {}

    def close(self) -> None:
        for w in self.writers:
            with contextlib.suppress(Exception):
                w.close()

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        splitter = FrameSplitter()
        while data := await reader.read(65536):
            for ftype, payload_at, frame in splitter.feed(data):
                if not await self._forward(writer, direction, ftype, payload_at, frame):
                    self.close()
                    return
        with contextlib.suppress(Exception):
            writer.write_eof()

    def _hit(self, direction: str, ftype: int, frame: bytes) -> Fault | None:
        self.relay.frames[direction, ftype] += 1
        if self.relay.plan is not None:
            self.per_type[direction, ftype] += 1
            planned = self.relay.plan(direction, ftype, self.per_type[direction, ftype], frame)
            if planned is not None:
                self.relay.log.append((direction, ftype, planned))
            return planned
        fault = self.relay.fault
        if fault is None or self.relay.fired is not None or fault.direction != direction:
            return None
        if fault.frame_type is not None and fault.frame_type != ftype:
            return None
        if self.epoch != self.relay.epoch:
            self.epoch, self.counts = self.relay.epoch, {"up": 0, "down": 0}
        n = self.counts[direction]
        self.counts[direction] += 1
        if n != fault.nth:
            return None
        self.relay.fired = time.monotonic()
        return fault

    async def _forward(self, writer: asyncio.StreamWriter, direction: str, ftype: int, payload_at: int,
                       frame: bytes) -> bool:
        """Send one frame (with the armed fault if it hits); False closes the connection."""
        fault = self._hit(direction, ftype, frame)
        out = [frame]
        if fault is not None:
            kind = fault.kind
            if kind == "close":
                return False
            if kind == "truncate":
                writer.write(frame[:max(1, len(frame) // 2)])
                await writer.drain()
                return False
            if kind == "drop":
                out = []
            elif kind == "delay":
                await asyncio.sleep(fault.delay_s)
            elif kind == "duplicate":
                out = [frame, frame]
            elif kind == "reorder":
                self.held[direction] = frame
                return True
            elif kind == "flip_header":                    # fixed header or message header
                out = [flip(frame, 0, payload_at, fault.bit, fault.position)]
            elif kind == "flip_message":                   # the message header only (its fields)
                out = [flip(frame, FIXED_SIZE, payload_at, fault.bit, fault.position)]
            elif kind == "flip_payload":
                out = [flip(frame, payload_at, len(frame), fault.bit, fault.position)]
        elif direction in self.held:                 # the frame after a held one goes first
            out = [frame, self.held.pop(direction)]
        for piece in out:
            writer.write(piece)
        await writer.drain()
        return True


class RelayThread:
    """A FaultRelay on its own event loop and thread: `start(listen)` → the port it listens on, `stop()`."""

    def __init__(self, relay: FaultRelay):
        self.relay = relay
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self, listen: tuple[str, int] = ("127.0.0.1", 0)) -> int:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.relay.start(listen), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.relay.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
