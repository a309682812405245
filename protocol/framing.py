"""Frame layout (version 2): a 20-byte fixed header, a msgpack header, a raw payload, a 16-byte tag.

    offset   size  field
    0        4     magic  b"EDGC"
    4        1     protocol version (2)
    5        1     frame type (= message tag)
    6        2     flags (bit 0: key phase of a sealed frame, cipher.py; the others reserved, 0)
    8        4     header length H (u32 LE)
    12       4     payload length P (u32 LE)
    16       4     CRC-32 of bytes 0..15 (the lengths are only trusted once this matches)
    20       H     msgpack-encoded message
    20+H     P     payload (raw bytes, e.g. encoded K and V planes)
    20+H+P   16    MAC tag over bytes 0..20+H+P and the implicit sequence number (mac.py)

Life cycle of the bytes of one connection: `FrameParser` is sans-IO; feed bytes (`feed`) or let an
I/O layer receive straight into it (`get_buffer` / `buffer_updated`, as asyncio's BufferedProtocol
does), then take complete frames (`next_frame`). The fixed header's CRC, magic, version, flags and
both lengths are checked as soon as its 20 bytes are in, before any buffer for the frame is
allocated, against the limits of the connection's state (`set_limits`: small before
authentication). Once a large frame's size is known its buffer is allocated at exactly that size
and reads stop at its end, so the frame is handed out without another copy. `close` releases the
buffer. The parser never checks tags: it has no keys (state.py does, with mac.py).

A version-1 frame (16-byte fixed header, no CRC, no tag) is still parsed far enough to read an old
peer's Error, so that the version mismatch can be reported clearly in both directions.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from edgecore.protocol.errors import ErrorCode, RemoteProtocolError

MAGIC = b"EDGC"
VERSION = 2
LEGACY_VERSION = 1
PREFIX = struct.Struct("<4sBBHII")    # magic, version, type, flags, header length, payload length
CRC = struct.Struct("<I")
FIXED_SIZE = PREFIX.size + CRC.size  # 20
LEGACY_FIXED_SIZE = PREFIX.size      # 16 (version 1)
TAG_SIZE = 16
SEALED = 0                           # frame type of an encrypted frame: its message type is inside (cipher.py)
KEY_PHASE = 0x1                      # flag: the sealed frame's key phase (flips at each key update)
CHUNK = 1 << 16                      # read size while no large frame is pending


@dataclass(frozen=True)
class Limits:
    max_header: int = 64 * 1024
    max_payload: int = 64 * 1024 * 1024
    max_buffer: int = 72 * 1024 * 1024


# Before both sides have proved the secret only handshake-sized frames are accepted, and the
# parser's buffer never grows past max_buffer: an unauthenticated peer costs a few KiB.
HANDSHAKE_LIMITS = Limits(max_header=4096, max_payload=0, max_buffer=8192)


@dataclass
class RawFrame:
    version: int
    frame_type: int
    header: memoryview
    payload: memoryview
    signed: memoryview      # fixed header ‖ header ‖ payload: what the tag covers
    tag: memoryview         # empty for a version-1 frame
    flags: int = 0


def pack_fixed(frame_type: int, header_len: int, payload_len: int, version: int = VERSION, flags: int = 0) -> bytes:
    prefix = PREFIX.pack(MAGIC, version, frame_type, flags, header_len, payload_len)
    if version == LEGACY_VERSION:
        return prefix
    return prefix + CRC.pack(zlib.crc32(prefix))


def _total(need: tuple[int, int, int, int, int]) -> int:
    """Bytes of a whole frame, from its parsed fixed header (version, type, fixed size, H, P)."""
    _, _, fixed, hlen, plen = need
    return fixed + hlen + plen + (TAG_SIZE if fixed == FIXED_SIZE else 0)


class FrameParser:
    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._buf = bytearray(min(CHUNK, self.limits.max_buffer))
        self._len = 0                                     # filled bytes at the front of _buf
        self._need: tuple[int, int, int, int, int] | None = None  # version, type, fixed, H, P
        self._flags = 0                                   # the pending frame's flags

    @property
    def buffered(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        """Bytes allocated for input (what an idle or unauthenticated connection costs)."""
        return len(self._buf)

    def set_limits(self, limits: Limits) -> None:
        """Limits for the frames after the current one (a connection's state changed)."""
        self.limits = limits

    def close(self) -> None:
        self._buf, self._len, self._need = bytearray(), 0, None

    # ---- input ----------------------------------------------------------------
    def feed(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if self._len + n > self.limits.max_buffer:
            raise RemoteProtocolError("peer sent more data than the frame limits allow", ErrorCode.FRAME_TOO_LARGE)
        if self._len + n > len(self._buf):
            self._grow(max(self._len + n, min(CHUNK, self.limits.max_buffer)))
        self._buf[self._len:self._len + n] = data
        self._len += n

    def get_buffer(self) -> memoryview:
        """Free space to receive into: up to the end of a large pending frame, else a chunk."""
        self._parse_fixed()
        if self._need is not None:
            total = _total(self._need)
            if total > len(self._buf):
                self._grow(total)
            if total > CHUNK and self._len < total:
                return memoryview(self._buf)[self._len:total]
        room = len(self._buf) - self._len
        target = min(self._len + CHUNK, self.limits.max_buffer)
        if room < CHUNK // 4 and target > len(self._buf):
            self._grow(target)
            room = len(self._buf) - self._len
        if room <= 0:
            raise RemoteProtocolError("peer sent more data than the frame limits allow", ErrorCode.FRAME_TOO_LARGE)
        return memoryview(self._buf)[self._len:]

    def buffer_updated(self, nbytes: int) -> None:
        self._len += nbytes
        self._parse_fixed()

    @property
    def pending_flags(self) -> int:
        """The flags of the frame whose fixed header is in (0 when none is)."""
        return self._flags if self._need is not None else 0

    @property
    def large_frame_pending(self) -> bool:
        """A version-2 frame larger than a read chunk is arriving (its fixed header is in)."""
        return self._need is not None and self._need[2] == FIXED_SIZE and _total(self._need) > CHUNK

    def feed_signed(self, fn: Callable[[memoryview], object], start: int) -> int:
        """Pass the pending large frame's signed bytes from `start` up to what has arrived to `fn` (a MAC
        computed as the bytes arrive, while they are still in cache); returns the new position."""
        need = self._need
        if need is None or not self.large_frame_pending:
            return start
        _, _, fixed, hlen, plen = need
        stop = min(self._len, fixed + hlen + plen)
        if stop > start:
            with memoryview(self._buf) as buf:
                fn(buf[start:stop])
        return max(start, stop)

    @property
    def full(self) -> bool:
        """Stop receiving until a frame is taken: a large frame fills its buffer, or the limit is reached."""
        self._parse_fixed()
        if self._len >= self.limits.max_buffer:
            return True
        if self._need is None:
            return False
        total = _total(self._need)
        return total > CHUNK and self._len >= total

    def _grow(self, size: int) -> None:
        new = bytearray(size)
        new[:self._len] = memoryview(self._buf)[:self._len]
        self._buf = new

    # ---- frames ---------------------------------------------------------------
    def _parse_fixed(self) -> None:
        if self._need is not None or self._len < 5:
            return
        if self._buf[:4] != MAGIC:
            raise RemoteProtocolError(f"bad frame magic {bytes(self._buf[:4])!r} (not an edgecore peer?)")
        version = self._buf[4]
        if version not in (VERSION, LEGACY_VERSION):
            raise RemoteProtocolError(f"peer speaks edgecore protocol version {version}; this side speaks "
                                      f"version {VERSION}", ErrorCode.VERSION_MISMATCH)
        fixed = FIXED_SIZE if version == VERSION else LEGACY_FIXED_SIZE
        if self._len < fixed:
            return
        _, _, ftype, flags, hlen, plen = PREFIX.unpack_from(self._buf, 0)
        if version == VERSION and CRC.unpack_from(self._buf, PREFIX.size)[0] != zlib.crc32(self._buf[:PREFIX.size]):
            raise RemoteProtocolError("a frame's fixed header failed its CRC (corrupted lengths or type): the "
                                      "stream cannot be parsed further", ErrorCode.CHECKSUM)
        if flags & ~KEY_PHASE or (flags and ftype != SEALED):
            raise RemoteProtocolError(f"unknown frame flags {flags:#x}")
        if hlen > self.limits.max_header:
            raise RemoteProtocolError(f"frame header of {hlen} bytes exceeds the limit of "
                                      f"{self.limits.max_header}", ErrorCode.FRAME_TOO_LARGE)
        if plen > self.limits.max_payload:
            raise RemoteProtocolError(f"frame payload of {plen} bytes exceeds the limit of "
                                      f"{self.limits.max_payload}", ErrorCode.FRAME_TOO_LARGE)
        self._need, self._flags = (version, ftype, fixed, hlen, plen), flags

    def next_frame(self) -> RawFrame | None:
        self._parse_fixed()
        if self._need is None:
            return None
        version, ftype, fixed, hlen, plen = self._need
        total = _total(self._need)
        if self._len < total:
            return None
        rest = self._len - total
        frame_bytes: bytes | bytearray
        if total > CHUNK and rest <= CHUNK:
            # Hand the buffer itself to the frame; copy only the (small) remainder.
            frame_bytes = self._buf
            self._buf = bytearray(max(min(CHUNK, self.limits.max_buffer), rest))
            self._buf[:rest] = memoryview(frame_bytes)[total:self._len]
            del frame_bytes[total:]
        else:
            with memoryview(self._buf) as buf:
                frame_bytes = bytes(buf[:total])
                buf[:rest] = buf[total:self._len]
        self._len = rest
        flags, self._need, self._flags = self._flags, None, 0
        view = memoryview(frame_bytes)
        end = fixed + hlen + plen
        return RawFrame(version, ftype, view[fixed:fixed + hlen], view[fixed + hlen:end], view[:end], view[end:total],
                        flags)
