"""Per-part precision of MLA latent chunks: the rope plane is coded one step finer than the chunk's lossy
codec (measured on pystd-mla: bench/kv_quality.py), both ends deriving it from the codec name and the plane
widths; per-head chunks are unchanged, and a peer decoding the rope plane with the chunk's codec either fails
loudly or (between entropy levels, which share a self-describing format) decodes the same values."""

import numpy as np
import pytest

from edgecore.protocol.codecs import CODECS, PlaneInfo
from edgecore.protocol.errors import CodecError
from edgecore.protocol.kv import LATENT_ROPE_CODEC, decode_chunk, encode_chunk, plane_codecs


def bf16_bits(shape, seed: int, scale: float = 1.0) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    x, y = to_f32(a), to_f32(b)
    return float(np.sqrt(((x - y) ** 2).mean() / (x ** 2).mean()))


def test_plane_codecs():
    for codec in CODECS:
        assert plane_codecs(codec, latent=False) == (codec, codec)
    assert plane_codecs("int4", True) == ("int4", "int8")
    assert plane_codecs("q2e", True) == ("q2e", "q3e")
    for codec in ("raw", "lossless", "fp8", "int8"):
        assert plane_codecs(codec, True) == (codec, codec)
    assert all(finer in CODECS for finer in LATENT_ROPE_CODEC.values())


@pytest.mark.parametrize("codec", sorted(LATENT_ROPE_CODEC))
def test_latent_chunk_codes_rope_plane_finer(codec):
    latent, rope = bf16_bits((2, 200, 1, 64), 1), bf16_bits((2, 200, 1, 16), 2, 2.0)
    data = encode_chunk("r", latent, rope, layer_start=0, token_start=0, dtype="bfloat16", codec=codec,
                        total_tokens=200)
    vinfo = PlaneInfo("bfloat16", rope.shape, "v", 0, 200, 0)
    finer = CODECS[LATENT_ROPE_CODEC[codec]]
    assert bytes(data.payload[data.chunk.k_bytes:]) == bytes(finer.encode(rope, vinfo))
    k, v = decode_chunk(data)
    assert np.array_equal(k, CODECS[codec].decode(CODECS[codec].encode(latent, PlaneInfo(
        "bfloat16", latent.shape, "k", 0, 200, 0)), PlaneInfo("bfloat16", latent.shape, "k", 0, 200, 0)))
    same = CODECS[codec].decode(CODECS[codec].encode(rope, vinfo), vinfo)
    assert rel_err(rope, v) < rel_err(rope, same)                   # finer than the chunk's own codec
    try:                    # a peer that ignores the rule: an error, or (entropy levels share one self-describing
        old = CODECS[codec].decode(data.payload[data.chunk.k_bytes:], vinfo)     # format) the very same values
    except CodecError:
        old = None
    assert old is None and codec in ("int4", "q4e") or np.array_equal(old, v)


def test_per_head_chunk_codes_both_planes_alike():
    k, v = bf16_bits((2, 100, 2, 32), 3), bf16_bits((2, 100, 2, 32), 4)
    data = encode_chunk("r", k, v, layer_start=0, token_start=0, dtype="bfloat16", codec="int4", total_tokens=100)
    vinfo = PlaneInfo("bfloat16", v.shape, "v", 0, 100, 0)
    assert bytes(data.payload[data.chunk.k_bytes:]) == bytes(CODECS["int4"].encode(v, vinfo))
    _, got = decode_chunk(data)
    assert np.array_equal(got, CODECS["int4"].decode(CODECS["int4"].encode(v, vinfo), vinfo))
