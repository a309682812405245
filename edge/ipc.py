"""Messages between the edge's HTTP frontend process and its engine process.

The two processes share one stream socket (a socketpair made by the
frontend). Each message is a frame: u32 LE length, then a msgpack-encoded
tagged struct (msgspec; no pickle). The frontend sends `Generate`, `Abort`
and `Call`; the engine process answers with `Hello` once (when its model is
loaded), `Outputs` (every output produced in one event-loop turn, for all
requests together: one frame per engine step, not one per token), `Failed`
(a request's stream broke) and `Reply` (to a `Call`).

`FrameBuffer` is the sans-IO half: feed it bytes, take whole messages out.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EdgecoreError

MAX_FRAME = 256 * 1024 * 1024
_LEN = struct.Struct("<I")


class Generate(msgspec.Struct, tag="generate"):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class Call(msgspec.Struct, tag="call"):
    """Run one of the engine process's `CALLS` (stats, metrics, prefetch, readiness, count_error)."""
    id: int
    method: str
    arg: Any = None


class Hello(msgspec.Struct, tag="hello"):
    max_model_len: int
    vocab_size: int
    fingerprint: str


class Outputs(msgspec.Struct, tag="outputs"):
    items: list[RequestOutput]


class Failed(msgspec.Struct, tag="failed"):
    """A request's stream broke: `kind` "request" is the caller's fault (a RequestError), else "engine"."""
    request_id: str
    message: str
    kind: str = "engine"
    param: str | None = None
    code: str | None = None


class Reply(msgspec.Struct, tag="reply"):
    id: int
    result: Any = None
    error: str | None = None


Message = Generate | Abort | Call | Hello | Outputs | Failed | Reply

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class IpcError(Exception):
    """A malformed frame from the other process (a bug, or a version mismatch)."""


def encode(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


class FrameBuffer:
    """Bytes in, messages out."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out, pos = [], 0
        while len(self._buf) - pos >= 4:
            (n,) = _LEN.unpack_from(self._buf, pos)
            if n > MAX_FRAME:
                raise IpcError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
            if len(self._buf) - pos - 4 < n:
                break
            try:
                out.append(_decoder.decode(memoryview(self._buf)[pos + 4:pos + 4 + n]))
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, EdgecoreError) as exc:
                raise IpcError(f"malformed message: {exc}") from None
            pos += 4 + n
        del self._buf[:pos]
        return out
