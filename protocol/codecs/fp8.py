"""`fp8` (id 2): float8 e4m3 (fn variant: max 448, no infinities) with a scale per layer and head.

Byte layout: float32 LE scales [layers × heads] | one e4m3 code byte per value,
in the plane's [layers, tokens, heads, head_dim] order. value ≈ e4m3(code) × scale.
"""

from __future__ import annotations

import numpy as np

from edgecore.protocol.codecs.base import Codec, PlaneInfo, check_bits, from_float32, to_float32
from edgecore.protocol.errors import CodecError

FP8_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    table = (sign * mag).astype(np.float32)
    table[0x7F] = table[0xFF] = np.nan
    return table


E4M3 = _e4m3_table()


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 in [-448, 448] → e4m3 codes (round to nearest even)."""
    ax = np.minimum(np.abs(x), FP8_MAX).astype(np.float32)
    u = ax.view(np.uint32)
    rounded = (u + (0x7FFFF + ((u >> 20) & 1))) & np.uint32(0xFFF00000)
    exp = (rounded >> 23).astype(np.int32) - 120          # rebias 127 → 7
    normal = ((exp << 3) | ((rounded >> 20) & 7).astype(np.int32))
    sub = np.rint(ax * 512.0).astype(np.int32)            # multiples of 2^-9 below 2^-6
    code = np.where(ax < 2.0 ** -6, sub, normal)
    code = np.minimum(code, 0x7E).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 7)


class Fp8Codec(Codec):
    name, codec_id, lossless = "fp8", 2, False

    def encode(self, bits: np.ndarray, info: PlaneInfo) -> bytes:
        check_bits(bits, info)
        x = to_float32(bits, info.dtype)
        amax = np.abs(x).max(axis=(1, 3))                 # [layers, heads]
        scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
        codes = encode_e4m3(x / scale[:, None, :, None])
        return scale.tobytes() + codes.tobytes()

    def decode(self, data: bytes | memoryview, info: PlaneInfo) -> np.ndarray:
        layers, tokens, heads, dim = info.shape
        nscale = layers * heads * 4
        if len(data) != nscale + info.count:
            raise CodecError(f"fp8 plane has {len(data)} bytes, expected {nscale + info.count}")
        scale = np.frombuffer(data, dtype=np.float32, count=layers * heads).reshape(layers, 1, heads, 1)
        codes = np.frombuffer(data, dtype=np.uint8, offset=nscale).reshape(info.shape)
        return from_float32(E4M3[codes] * scale, info.dtype)
