"""KV chunks: numpy K/V planes ↔ a KVData frame.

Life cycle: the core calls `encode_chunk` for each (request, layer range,
token range) as soon as those layers are computed; the edge calls
`decode_chunk` on arrival, which checks the ranges and the decoded size
against the header. Integrity is not checked here: the frame's MAC covers
header and payload, and a frame that fails it never becomes a KVData
(state.py), so a flipped bit fails the request, it never decodes silently.

The two planes share layers, tokens and heads; their widths may differ (the MLA latent layout:
plane 0 the compressed KV, plane 1 the rotary key). `head_dim` is plane 0's width and `raw_len` the
raw size of both planes, from which the receiver derives plane 1's width.

Per-part precision of latent chunks (planes of different widths): the rope plane, a fifth of an MLA
token's bytes, carries as much of a lossy codec's error into the next-token distribution as the whole
latent plane (bench/kv_quality.py on models/pystd-mla), so `plane_codecs` codes it one step finer than the
chunk's codec (`LATENT_ROPE_CODEC`). Both ends derive it from the chunk's codec name and plane widths.
"""

from __future__ import annotations

import numpy as np

from edgecore.protocol.codecs import PlaneInfo, get_codec
from edgecore.protocol.errors import CodecError
from edgecore.protocol.messages import KVChunk
from edgecore.protocol.events import KVData

# Below this many K+V bytes, encoding or decoding a chunk takes less time than handing it to a worker
# thread and back, so callers do it in place.
SMALL_CHUNK_BYTES = 128 * 1024

LATENT_ROPE_CODEC = {"int4": "int8", "q4e": "int4", "q3e": "q4e", "q2e": "q3e"}


def plane_codecs(codec: str, latent: bool) -> tuple[str, str]:
    """The codecs of plane 0 and plane 1 of a chunk whose codec is `codec` (latent: an MLA chunk)."""
    return codec, (LATENT_ROPE_CODEC.get(codec, codec) if latent else codec)


def _head_slice(channels: tuple, head_start: int, heads: int, width: int) -> tuple:
    """Per-layer channel scales of the model's heads → those of heads [head_start, head_start + heads)."""
    return tuple(row[head_start * width:(head_start + heads) * width] for row in channels)


def encode_chunk(request_id: str, k: np.ndarray, v: np.ndarray, *, layer_start: int, token_start: int,
                 head_start: int = 0, dtype: str, codec: str, total_tokens: int = 0,
                 rope: tuple[float, ...] | None = None, step_scales: dict | None = None,
                 compact_params: bool = True) -> KVData:
    """k, v: raw bits [layers, tokens, heads, width] (uint16 for 16-bit dtypes, uint32 for float32); the
    widths may differ, nothing else (MLA's latent and RoPE planes). `rope`: the model's RoPE inverse
    frequencies, when the decoding side passes them too (see codecs/equant.py). `step_scales`: the model's bit
    allocation for the encoder, {"k": per-layer step multipliers, "v": ..., optionally "k_channels" /
    "v_channels": per layer, multipliers of the model's kv_heads × head_dim channels} (decoders need none).
    `compact_params`: the receiver decodes compact parameters (its capability "kv-compact-params")."""
    impl = get_codec(codec)
    layers, tokens, heads, dim = k.shape
    if v.shape[:3] != k.shape[:3]:
        raise CodecError(f"K/V planes differ in layers, tokens or heads: {k.shape} vs {v.shape}")
    scales = step_scales or {}
    kinfo = PlaneInfo(dtype, k.shape, "k", token_start, total_tokens, layer_start, rope, tuple(scales.get("k", ())),
                      _head_slice(scales.get("k_channels", ()), head_start, heads, dim), compact_params)
    vinfo = PlaneInfo(dtype, v.shape, "v", token_start, total_tokens, layer_start,
                      step_scales=tuple(scales.get("v", ())),
                      channel_scales=_head_slice(scales.get("v_channels", ()), head_start, heads, v.shape[3]),
                      compact_params=compact_params)
    ek = impl.encode(k, kinfo)
    ev = get_codec(plane_codecs(codec, v.shape[3] != dim)[1]).encode(v, vinfo)
    payload = memoryview(b"".join((ek, ev)))
    chunk = KVChunk(request_id, layer_start, layer_start + layers, token_start, token_start + tokens,
                    head_start, head_start + heads, dim, dtype, codec, len(ek), kinfo.raw_bytes + vinfo.raw_bytes,
                    total_tokens)
    return KVData(chunk, payload)


def decode_chunk(data: KVData, rope: tuple[float, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    c = data.chunk
    if not (0 <= c.layer_start < c.layer_end and 0 <= c.token_start < c.token_end
            and 0 <= c.head_start < c.head_end and c.head_dim > 0):
        raise CodecError(f"KV chunk of request {c.request_id} has an empty or negative range")
    shape = (c.layer_end - c.layer_start, c.token_end - c.token_start, c.head_end - c.head_start, c.head_dim)
    impl = get_codec(c.codec)
    kinfo = PlaneInfo(c.dtype, shape, "k", c.token_start, c.total_tokens, c.layer_start, rope)
    row_bytes = kinfo.raw_bytes // c.head_dim if kinfo.raw_bytes else 0     # one value across layers×tokens×heads
    v_dim, rest = divmod(c.raw_len - kinfo.raw_bytes, row_bytes) if row_bytes else (0, 1)
    if rest or v_dim <= 0:
        raise CodecError(f"KV chunk raw_len {c.raw_len} does not match its shape {shape}")
    payload = memoryview(data.payload)
    try:
        k = impl.decode(payload[:c.k_bytes], kinfo)
        v_impl = get_codec(plane_codecs(c.codec, v_dim != c.head_dim)[1])
        v = v_impl.decode(payload[c.k_bytes:], PlaneInfo(c.dtype, shape[:3] + (v_dim,), "v", c.token_start,
                                                         c.total_tokens, c.layer_start))
    except (ValueError, TypeError, IndexError) as exc:
        raise CodecError(f"KV chunk of request {c.request_id} does not decode: {exc}") from None
    return k, v
