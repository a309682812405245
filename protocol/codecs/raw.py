"""`raw` (id 0): the plane's little-endian bytes as they are."""

from __future__ import annotations

import numpy as np

from edgecore.protocol.codecs.base import BITS_DTYPES, Codec, PlaneInfo, check_bits
from edgecore.protocol.errors import CodecError


class RawCodec(Codec):
    name, codec_id, lossless = "raw", 0, True

    def encode(self, bits: np.ndarray, info: PlaneInfo) -> memoryview:
        check_bits(bits, info)
        return np.ascontiguousarray(bits).data.cast("B")

    def decode(self, data: bytes | memoryview, info: PlaneInfo) -> np.ndarray:
        if len(data) != info.raw_bytes:
            raise CodecError(f"raw plane has {len(data)} bytes, expected {info.raw_bytes}")
        return np.frombuffer(data, dtype=BITS_DTYPES[info.dtype]).reshape(info.shape)
