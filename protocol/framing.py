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

`FrameParser` is sans-IO: feed bytes, take complete frames. Both lengths are
checked against the limits as soon as the 16 fixed bytes are in, before any
buffer for the frame is allocated.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from protocol.errors import ErrorCode, RemoteProtocolError

MAGIC = b"EDGC"
FIXED = struct.Struct("<4sBBHII")
FIXED_SIZE = FIXED.size  # 16


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


def pack_fixed(version: int, frame_type: int, header_len: int, payload_len: int) -> bytes:
    return FIXED.pack(MAGIC, version, frame_type, 0, header_len, payload_len)


class FrameParser:
    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._buf = bytearray()
        self._need: tuple[int, int, int, int] | None = None   # version, type, header, payload

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        if len(self._buf) + len(data) > self.limits.max_buffer:
            raise RemoteProtocolError("peer sent more data than the frame limits allow",
                                      ErrorCode.FRAME_TOO_LARGE)
        self._buf += data

    def next_frame(self) -> RawFrame | None:
        if self._need is None:
            if len(self._buf) < FIXED_SIZE:
                return None
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
        version, ftype, hlen, plen = self._need
        total = FIXED_SIZE + hlen + plen
        if len(self._buf) < total:
            return None
        rest = len(self._buf) - total
        if rest <= total:
            # Hand the buffer itself to the frame and copy only the (smaller) remainder,
            # so a large KV payload is never copied out of the receive buffer.
            frame_bytes = self._buf
            self._buf = bytearray(frame_bytes[total:]) if rest else bytearray()
            del frame_bytes[total:]
        else:
            with memoryview(self._buf) as buf:
                frame_bytes = bytes(buf[:total])
            del self._buf[:total]
        self._need = None
        view = memoryview(frame_bytes)
        return RawFrame(version, ftype, view[FIXED_SIZE:FIXED_SIZE + hlen], view[FIXED_SIZE + hlen:])
