"""Frame layout: a fixed 16-byte header, a msgpack message header, a raw payload.

    offset size  field
    0      4     magic  b"EDGC"
    4      1     protocol version
    5      1     frame type (= message tag)
    6      2     flags (reserved, 0)
    8      4     header length (u32 LE)
    12     4     payload length (u32 LE)
    16     H     msgpack-encoded message
    16+H   P     payload (raw bytes, e.g. encoded K and V planes)

`FrameParser` is sans-IO: feed bytes (`feed`) or let an I/O layer receive
straight into it (`get_buffer` / `buffer_updated`, as asyncio's
BufferedProtocol does), then take complete frames (`next_frame`). Both lengths
are checked against the limits as soon as the 16 fixed bytes are in, before
any buffer for the frame is allocated. Once a large frame's size is known, its
buffer is allocated at exactly that size and reads stop at its end, so the
frame is handed out without another copy.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from edgecore.protocol.errors import ErrorCode, RemoteProtocolError

MAGIC = b"EDGC"
FIXED = struct.Struct("<4sBBHII")
FIXED_SIZE = FIXED.size  # 16
CHUNK = 1 << 16          # read size while no large frame is pending


@dataclass(frozen=True)
class Limits:
    max_header: int = 64 * 1024
    max_payload: int = 64 * 1024 * 1024
    max_buffer: int = 72 * 1024 * 1024


@dataclass
class RawFrame:
    version: int
    frame_type: int
    header: memoryview
    payload: memoryview
    payload_crc: int = 0        # CRC-32 of the payload, computed as its bytes arrived


def pack_fixed(version: int, frame_type: int, header_len: int, payload_len: int) -> bytes:
    return FIXED.pack(MAGIC, version, frame_type, 0, header_len, payload_len)


class FrameParser:
    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._buf = bytearray(CHUNK)
        self._len = 0                                           # filled bytes at the front of _buf
        self._need: tuple[int, int, int, int] | None = None   # version, type, header, payload
        self._crc = 0                   # running CRC-32 of the pending frame's payload ...
        self._crc_pos = 0               # ... over buffer bytes up to here

    @property
    def buffered(self) -> int:
        return self._len

    # ---- input ----------------------------------------------------------------
    def feed(self, data) -> None:
        n = len(data)
        if self._len + n > self.limits.max_buffer:
            raise RemoteProtocolError("peer sent more data than the frame limits allow",
                                      ErrorCode.FRAME_TOO_LARGE)
        if self._len + n > len(self._buf):
            self._grow(self._len + n)
        self._buf[self._len:self._len + n] = data
        self._len += n

    def get_buffer(self) -> memoryview:
        """Free space to receive into: up to the end of a large pending frame, else a chunk."""
        self._parse_fixed()
        if self._need is not None:
            total = FIXED_SIZE + self._need[2] + self._need[3]
            if total > len(self._buf):
                self._grow(total)
            if total > CHUNK or self._len < total:
                end = total if total > CHUNK else len(self._buf)
                return memoryview(self._buf)[self._len:end]
        if len(self._buf) - self._len < CHUNK // 4:
            self._grow(self._len + CHUNK)
        return memoryview(self._buf)[self._len:]

    def buffer_updated(self, nbytes: int) -> None:
        self._len += nbytes
        self._parse_fixed()
        self._hash_payload(self._len)   # while the new bytes are still in cache

    def _hash_payload(self, end: int) -> None:
        if self._need is None:
            return
        stop = min(end, FIXED_SIZE + self._need[2] + self._need[3])
        if stop > self._crc_pos:
            with memoryview(self._buf) as buf:
                self._crc = zlib.crc32(buf[self._crc_pos:stop], self._crc)
            self._crc_pos = stop

    @property
    def full(self) -> bool:
        """A large frame fills its buffer: take it (`next_frame`) before receiving more."""
        self._parse_fixed()
        if self._need is None:
            return False
        total = FIXED_SIZE + self._need[2] + self._need[3]
        return total > CHUNK and self._len >= total

    def _grow(self, size: int) -> None:
        new = bytearray(max(size, CHUNK))
        new[:self._len] = memoryview(self._buf)[:self._len]
        self._buf = new

    # ---- frames ---------------------------------------------------------------
    def _parse_fixed(self) -> None:
        if self._need is not None or self._len < FIXED_SIZE:
            return
        magic, version, ftype, flags, hlen, plen = FIXED.unpack_from(self._buf, 0)
        if magic != MAGIC:
            raise RemoteProtocolError(f"bad frame magic {bytes(magic)!r} (not an edgecore peer?)")
        if flags != 0:
            raise RemoteProtocolError(f"unknown frame flags {flags:#x}")
        if hlen > self.limits.max_header:
            raise RemoteProtocolError(f"frame header of {hlen} bytes exceeds the limit of "
                                      f"{self.limits.max_header}", ErrorCode.FRAME_TOO_LARGE)
        if plen > self.limits.max_payload:
            raise RemoteProtocolError(f"frame payload of {plen} bytes exceeds the limit of "
                                      f"{self.limits.max_payload}", ErrorCode.FRAME_TOO_LARGE)
        self._need = (version, ftype, hlen, plen)
        self._crc, self._crc_pos = 0, FIXED_SIZE + hlen

    def next_frame(self) -> RawFrame | None:
        self._parse_fixed()
        if self._need is None:
            return None
        version, ftype, hlen, plen = self._need
        total = FIXED_SIZE + hlen + plen
        if self._len < total:
            return None
        self._hash_payload(total)
        crc = self._crc & 0xFFFFFFFF
        rest = self._len - total
        if total > CHUNK and rest <= CHUNK:
            # Hand the buffer itself to the frame; copy only the (small) remainder.
            frame_bytes = self._buf
            self._buf = bytearray(max(CHUNK, rest))
            self._buf[:rest] = memoryview(frame_bytes)[total:self._len]
            del frame_bytes[total:]
        else:
            with memoryview(self._buf) as buf:
                frame_bytes = bytes(buf[:total])
                buf[:rest] = buf[total:self._len]
        self._len = rest
        self._need = None
        view = memoryview(frame_bytes)
        return RawFrame(version, ftype, view[FIXED_SIZE:FIXED_SIZE + hlen], view[FIXED_SIZE + hlen:], crc)
