"""Messages between the edge's HTTP frontend process and its engine process.

The two processes share one stream socket (a socketpair made by the
frontend). Each message is a frame: u32 LE length, then a msgpack-encoded
tagged struct (msgspec; no pickle). They carry the `EdgeService` calls
(edge/service.py), one typed message per call: the frontend sends `Generate`,
`Abort`, `CountError`, and the calls `GetStats`, `GetMetrics`,
`GetReadiness`, `Prefetch` (each a `Call` with an id); the engine process answers with
`Hello` once (when its model is loaded), `Outputs` (every output produced in
one event-loop turn, for all requests together: one frame per engine step, not
one per token), `Failed` (a request's stream broke), and per call its typed
`CallReply` with the same id (`StatsReply`, `MetricsReply`, `ReadinessReply`,
`PrefetchReply`) or `RequestFailed`.

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
    group: str | None = None        # the request's fairness group (EdgeService.generate)
    cache_salt: str | None = None   # the request's prefix-cache scope (EdgeService.generate)
    tenant: str | None = None       # the request's tenant, its weight and its engine priority (band and own)
    weight: float = 1.0
    priority: int = 0
    adapter: str | None = None      # the request's LoRA adapter (shared/models/lora.py); None: the base model
    traceparent: str | None = None  # the HTTP process's span of the request (shared/node/tracing.py); None: untraced


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class CountError(msgspec.Struct, tag="count_error"):
    """The frontend answered an HTTP error (counted in the engine process's metrics); no reply."""
    status: str


class Call(msgspec.Struct):
    """A frontend request that gets exactly one reply carrying the same `id` (a `CallReply`)."""
    id: int


class CallReply(msgspec.Struct):
    """The engine process's answer to the `Call` with this `id`."""
    id: int


class GetStats(Call, tag="get_stats"):
    pass


class GetMetrics(Call, tag="get_metrics"):
    pass


class GetReadiness(Call, tag="get_readiness"):
    pass


class Prefetch(Call, tag="prefetch"):
    prompt_ids: list[int]


class LoadAdapter(Call, tag="load_adapter"):
    name: str
    path: str


class UnloadAdapter(Call, tag="unload_adapter"):
    name: str


class Hello(msgspec.Struct, tag="hello"):
    max_model_len: int
    vocab_size: int
    fingerprint: str
    adapters: dict[str, str] = {}      # LoRA adapters loaded at start: name → fingerprint


class Outputs(msgspec.Struct, tag="outputs"):
    items: list[RequestOutput]


class Failed(msgspec.Struct, tag="failed"):
    """A request's stream broke: `kind` "request" is the caller's fault (a RequestError), else "engine"."""
    request_id: str
    message: str
    kind: str = "engine"
    param: str | None = None
    code: str | None = None


class StatsReply(CallReply, tag="stats"):
    stats: dict[str, Any]              # the /stats body (engine snapshot, cores, placement model)


class MetricsReply(CallReply, tag="metrics"):
    text: str                          # Prometheus exposition


class ReadinessReply(CallReply, tag="readiness"):
    ready: bool
    cores_healthy: int


class PrefetchReply(CallReply, tag="prefetched"):
    tokens: int
    cached_tokens: int
    source: str                        # "local" or the core's address


class RequestFailed(CallReply, tag="request_failed"):
    error: str


class AdapterReply(CallReply, tag="adapter"):
    """A load or unload: the adapter's fingerprint, or the AdapterError's message and param (nothing changed)."""
    fingerprint: str = ""
    error: str | None = None
    param: str | None = None


Request = GetStats | GetMetrics | GetReadiness | Prefetch | LoadAdapter | UnloadAdapter
Reply = StatsReply | MetricsReply | ReadinessReply | PrefetchReply | RequestFailed | AdapterReply
Message = Generate | Abort | CountError | Request | Hello | Outputs | Failed | Reply

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class IpcError(Exception):
    """A malformed frame from the other process (a bug, or a version mismatch)."""


def encode(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


class FrameBuffer:
    """Bytes in, messages out."""

    def __init__(self) -> None:
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
