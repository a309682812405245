"""`int8` (id 3) and `int4` (id 4): KIVI-style asymmetric integer quantization, entropy-coded.

Keys are quantized per channel (min/max over groups of `key_group` tokens for
each layer, head and channel: key outliers live in channels); values per token
(min/max over groups of `value_group` channels). The first 4 prompt tokens
(attention sinks) and the last 64 are kept exact — encoded with the lossless
codec. Which tokens are exact follows from the chunk's token range and the
prompt length, so no index travels. Codes are packed (two per byte for int4)
and then zstd-coded; min and scale are float16 unless a value does not fit.

Byte layout: header (struct "<BBBBIIIIII": bits, kind 0=k/1=v, param dtype
0=f16/1=f32, 0, group, exact tokens, exact bytes, param bytes, code bytes,
packed code length) | lossless(exact tokens) | min plane | scale plane | zstd(codes).
"""

from __future__ import annotations

import struct

import numpy as np

from edgecore.protocol.codecs.base import (BITS_DTYPES, Codec, PlaneInfo, check_bits, from_float32, safe_inverse,
                                           to_float32, zstd_compress, zstd_decompress)
from edgecore.protocol.codecs.lossless import LosslessCodec
from edgecore.protocol.errors import CodecError

HEADER = struct.Struct("<BBBBIIIIII")
EXACT_HEAD, EXACT_RECENT = 4, 64
_lossless = LosslessCodec()


def exact_span(info: PlaneInfo) -> tuple[int, int]:
    """Chunk-local [a, b): the quantized tokens (the sinks before, the recent tokens from b on)."""
    tokens = info.shape[1]
    total = info.total_tokens or (info.token_start + tokens)
    a = min(tokens, max(0, EXACT_HEAD - info.token_start))
    return a, min(tokens, max(a, total - EXACT_RECENT - info.token_start))


def _to_f32(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":                 # one pass: widen and shift together
        return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)
    return to_float32(bits, dtype)


def exact_mask(info: PlaneInfo) -> np.ndarray:
    tokens = info.shape[1]
    pos = info.token_start + np.arange(tokens)
    total = info.total_tokens or (info.token_start + tokens)
    return (pos < EXACT_HEAD) | (pos >= total - EXACT_RECENT)


class QuantCodec(Codec):
    lossless = False

    def __init__(self, bits: int, name: str, codec_id: int, key_group: int = 128, value_group: int = 32):
        self.bits, self.name, self.codec_id = bits, name, codec_id
        self.levels = (1 << bits) - 1
        self.key_group, self.value_group = key_group, value_group

    def _groups(self, x: np.ndarray, kind: str):
        """Reshape so that axis -1... group members share min/scale; returns (grouped, restore)."""
        layers, tokens, heads, dim = x.shape
        if kind == "k":
            g = self.key_group
            ng = -(-tokens // g)
            if ng * g != tokens:
                x = np.concatenate([x, np.repeat(x[:, -1:], ng * g - tokens, axis=1)], axis=1)
            return x.reshape(layers, ng, g, heads, dim), 2, g
        g = self.value_group if dim % self.value_group == 0 else dim
        return x.reshape(layers, tokens, heads, dim // g, g), 4, g

    def encode(self, bits: np.ndarray, info: PlaneInfo) -> bytes:
        check_bits(bits, info)
        a, b = exact_span(info)          # exact tokens are [0, a) and [b, tokens): slices, not a mask
        exact = bits[:, :a] if b == info.shape[1] else np.concatenate([bits[:, :a], bits[:, b:]], axis=1)
        exact_bytes = _lossless.encode(exact, PlaneInfo(info.dtype, exact.shape)) if exact.size else b""
        quant = bits[:, a:b]
        params = codes_z = b""
        param_f32, group, packed_len = 0, 0, 0
        if quant.size:
            x = _to_f32(quant, info.dtype)
            grouped, axis, group = self._groups(x, info.kind)
            mn = grouped.min(axis=axis, keepdims=True)
            scale = (grouped.max(axis=axis, keepdims=True) - mn) / self.levels
            mn16, sc16 = mn.astype(np.float16), scale.astype(np.float16)
            if np.isfinite(mn16).all() and np.isfinite(sc16).all() and not ((sc16 == 0) & (scale > 0)).any():
                mn, scale = mn16.astype(np.float32), sc16.astype(np.float32)
                params = mn16.tobytes() + sc16.tobytes()
            else:
                param_f32 = 1
                params = mn.astype(np.float32).tobytes() + scale.astype(np.float32).tobytes()
            inv = safe_inverse(scale)
            y = grouped * inv                       # code = floor((x − min)/scale + 0.5), clipped
            y += 0.5 - mn * inv
            np.clip(y, 0, self.levels + 0.5, out=y)
            codes = y.astype(np.uint8)
            if info.kind == "k" and codes.shape[1] * codes.shape[2] != quant.shape[1]:
                codes = codes.reshape(codes.shape[0], -1, *codes.shape[3:])[:, :quant.shape[1]]
            codes = codes.reshape(-1)
            if self.bits == 4:
                if codes.size % 2:
                    codes = np.append(codes, np.uint8(0))
                codes = codes[0::2] | (codes[1::2] << 4)
            packed_len = codes.size
            codes_z = zstd_compress(codes)
        header = HEADER.pack(self.bits, 0 if info.kind == "k" else 1, param_f32, 0, group, exact.shape[1],
                             len(exact_bytes), len(params), len(codes_z), packed_len)
        return b"".join((header, exact_bytes, params, codes_z))

    def decode(self, data, info: PlaneInfo) -> np.ndarray:
        view = memoryview(data)
        if len(view) < HEADER.size:
            raise CodecError(f"{self.name} plane is truncated")
        nbits, kind, param_f32, _, group, n_exact, e_len, p_len, c_len, packed_len = HEADER.unpack_from(view)
        if nbits != self.bits or HEADER.size + e_len + p_len + c_len != len(view):
            raise CodecError(f"{self.name} plane header does not match its length")
        layers, tokens, heads, dim = info.shape
        mask = exact_mask(info)
        if int(mask.sum()) != n_exact:
            raise CodecError(f"{self.name} plane holds {n_exact} exact tokens, expected {int(mask.sum())}")
        out = np.empty(info.shape, dtype=BITS_DTYPES[info.dtype])
        pos = HEADER.size
        if n_exact:
            out[:, mask] = _lossless.decode(view[pos:pos + e_len], PlaneInfo(info.dtype, (layers, n_exact, heads, dim)))
        pos += e_len
        tq = tokens - n_exact
        if tq:
            pdtype = np.float32 if param_f32 else np.float16
            if kind == 0:
                ng = -(-tq // group)
                pshape, gshape = (layers, ng, 1, heads, dim), (layers, ng, group, heads, dim)
            else:
                pshape, gshape = (layers, tq, heads, dim // group, 1), (layers, tq, heads, dim // group, group)
            count = int(np.prod(pshape))
            if p_len != 2 * count * np.dtype(pdtype).itemsize:
                raise CodecError(f"{self.name} plane parameters have the wrong size")
            params = np.frombuffer(view[pos:pos + p_len], dtype=pdtype)
            mn = params[:count].reshape(pshape).astype(np.float32)
            scale = params[count:].reshape(pshape).astype(np.float32)
            pos += p_len
            n_codes = layers * tq * heads * dim if kind == 1 else int(np.prod(gshape))
            packed = np.frombuffer(zstd_decompress(view[pos:pos + c_len], packed_len), dtype=np.uint8)
            codes: np.ndarray
            if self.bits == 4:
                codes = np.empty(packed.size * 2, dtype=np.uint8)
                codes[0::2], codes[1::2] = packed & 0xF, packed >> 4
            else:
                codes = packed
            if kind == 0:
                real = layers * tq * heads * dim
                codes = codes[:real].reshape(layers, tq, heads, dim)
                pad = gshape[1] * group - tq
                if pad:
                    codes = np.concatenate([codes, np.zeros((layers, pad, heads, dim), np.uint8)], axis=1)
                x = mn + codes.reshape(gshape) * scale
                x = x.reshape(layers, -1, heads, dim)[:, :tq]
            else:
                x = (mn + codes[:n_codes].reshape(gshape) * scale).reshape(layers, tq, heads, dim)
            out[:, ~mask] = from_float32(x, info.dtype)
        return out
