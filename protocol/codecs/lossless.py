"""`lossless` (id 1): exponent plane entropy-coded, sign+mantissa plane stored; bit-exact.

Each value is rotated left by one bit, which moves the sign below the
mantissa and leaves the exponent in the top byte (all 8 exponent bits for
bfloat16 and float32; for float16 the 5 exponent bits plus the 3 top mantissa
bits). The top bytes form the exponent plane — few distinct values, so zstd
shrinks it several-fold — and the remaining bytes (sign+mantissa, close to
random) are stored as they are.

Byte layout: u32 LE length E of the zstd frame | E bytes zstd(exponent plane) |
sign+mantissa plane (1 byte per value for 16-bit types, 3 for float32).
"""

from __future__ import annotations

import struct

import numpy as np

from edgecore.protocol.codecs.base import BITS_DTYPES, Codec, PlaneInfo, check_bits, zstd_compress, zstd_decompress
from edgecore.protocol.codecs.planes import join_planes, split_planes
from edgecore.protocol.errors import CodecError

_LEN = struct.Struct("<I")


class LosslessCodec(Codec):
    name, codec_id, lossless = "lossless", 1, True

    def __init__(self, level: int = 1):
        self.level = level

    def encode(self, bits: np.ndarray, info: PlaneInfo) -> bytes:
        check_bits(bits, info)
        exponent, mantissa = split_planes(bits)
        packed = zstd_compress(exponent, self.level)
        return b"".join((_LEN.pack(len(packed)), packed, mantissa.data))

    def decode(self, data: bytes | memoryview, info: PlaneInfo) -> np.ndarray:
        n = info.count
        size = np.dtype(BITS_DTYPES[info.dtype]).itemsize
        view = memoryview(data)
        if len(view) < 4:
            raise CodecError("lossless plane is truncated")
        (elen,) = _LEN.unpack_from(view, 0)
        if 4 + elen + n * (size - 1) != len(view):
            raise CodecError(f"lossless plane has {len(view)} bytes, layout needs {4 + elen + n * (size - 1)}")
        exponent = zstd_decompress(view[4:4 + elen], n)
        return join_planes(exponent, view[4 + elen:], np.dtype(BITS_DTYPES[info.dtype]), n).reshape(info.shape)
