"""KV codec registry: name ↔ id ↔ implementation.

Peers advertise the codec names they support in Hello/Welcome and each
PrefillRequest lists those it allows; a KVChunk names the codec it used.
"""

from __future__ import annotations

from edgecore.protocol.codecs.base import Codec, PlaneInfo, from_float32, to_float32
from edgecore.protocol.codecs.equant import EntropyQuantCodec, Level
from edgecore.protocol.codecs.fp8 import Fp8Codec
from edgecore.protocol.codecs.lossless import LosslessCodec
from edgecore.protocol.codecs.quant import QuantCodec
from edgecore.protocol.codecs.raw import RawCodec
from edgecore.protocol.errors import CodecError

# Entropy-coded levels, finest first; their rates and quality are in edge/codec_policy.py (bench/kv_rd.py).
LEVELS = {
    "q4e": Level(key_factor=0.45, value_factor=0.5, recent=16, fine=32, compact=True),
    "q3e": Level(key_factor=0.52, value_factor=0.62, fine=16, compact=True),
    "q2e": Level(key_factor=0.65, value_factor=0.75, fine=16, compact=True),
}
CODECS: dict[str, Codec] = {c.name: c for c in (
    RawCodec(), LosslessCodec(), Fp8Codec(), QuantCodec(8, "int8", 3, zstd_level=-1), QuantCodec(4, "int4", 4),
    *(EntropyQuantCodec(name, 5 + i, level) for i, (name, level) in enumerate(LEVELS.items())))}
LOSSLESS = tuple(name for name, c in CODECS.items() if c.lossless)


def get_codec(name: str) -> Codec:
    codec = CODECS.get(name)
    if codec is None:
        raise CodecError(f"unknown KV codec '{name}' (known: {', '.join(CODECS)})")
    return codec


__all__ = ["CODECS", "LEVELS", "LOSSLESS", "Codec", "PlaneInfo", "get_codec", "to_float32", "from_float32"]
