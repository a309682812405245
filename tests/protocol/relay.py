"""A frame-aware TCP relay for fault injection: forwards edgecore (version 2) frames between a client
and a target and flips chosen bits, as a faulty link would. Usable from asyncio tests (`FrameRelay`)
and from process tests (`RelayThread`, its own event loop on a thread). It never corrupts two frames
in a row in one direction: that is indistinguishable from a drop or reorder, and by design fails the
connection (docs/wire-format.md §4)."""

from __future__ import annotations

import asyncio
import collections
import struct
import threading
from typing import Callable

from edgecore.protocol.framing import FIXED_SIZE, TAG_SIZE

# corrupt(direction "c2s" | "s2c", frame type, how many frames of that type this connection has seen so
# far in that direction (this one included), the frame's bytes) → a bit index into the frame to flip, or None.
Corrupt = Callable[[str, int, int, bytes], "int | None"]


class FrameRelay:
    def __init__(self, target_port: int, corrupt: Corrupt):
        self.target_port, self.corrupt = target_port, corrupt
        self.flipped: list[tuple[str, int, int]] = []       # (direction, frame type, bit)
        self.frames: collections.Counter = collections.Counter()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.close()

    async def _on_client(self, creader, cwriter) -> None:
        sreader, swriter = await asyncio.open_connection("127.0.0.1", self.target_port)
        counts: collections.Counter = collections.Counter()
        await asyncio.gather(self._pipe(creader, swriter, "c2s", counts),
                             self._pipe(sreader, cwriter, "s2c", counts), return_exceptions=True)

    async def _pipe(self, reader, writer, direction: str, counts) -> None:
        buf = bytearray()
        last_flipped = False
        try:
            while data := await reader.read(1 << 16):
                buf += data
                while len(buf) >= FIXED_SIZE:
                    hlen, plen = struct.unpack_from("<II", buf, 8)
                    total = FIXED_SIZE + hlen + plen + TAG_SIZE
                    if len(buf) < total:
                        break
                    frame = bytearray(buf[:total])
                    del buf[:total]
                    ftype = frame[5]
                    counts[direction, ftype] += 1
                    self.frames[direction, ftype] += 1
                    bit = self.corrupt(direction, ftype, counts[direction, ftype], bytes(frame))
                    last_flipped = bit is not None and not last_flipped
                    if last_flipped:
                        frame[bit // 8] ^= 1 << (bit % 8)
                        self.flipped.append((direction, ftype, bit))
                    writer.write(frame)
                await writer.drain()
        finally:
            writer.close()


class RelayThread:
    """A FrameRelay on its own event loop, for tests that drive real processes synchronously."""

    def __init__(self, target_port: int, corrupt: Corrupt):
        self.relay = FrameRelay(target_port, corrupt)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.relay.start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.relay.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
