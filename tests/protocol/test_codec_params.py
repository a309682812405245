"""Codes and steps as bytes (codes.py): 4-bit codes packed two per byte; compact parameters of the
entropy-coded levels (flag bits 2 and 3): log-coded steps rounded up, one centre for the main and fine
spans; their fallbacks (steps beyond the code range, no main span), payloads without them still
decoding, and inconsistent flags refused."""

import dataclasses

import numpy as np
import pytest

from edgecore.protocol.codecs import LEVELS, PlaneInfo, from_float32, get_codec, to_float32
from edgecore.protocol.codecs.codes import LOG_STEP_RES, log_step_codes, log_steps, pack_nibbles, unpack_nibbles
from edgecore.protocol.codecs.equant import FLAG_F32, FLAG_LOG_STEPS, FLAG_SHARED_CENTRE, HEADER, EntropyQuantCodec
from edgecore.protocol.errors import CodecError
from tests.protocol.test_codecs import _recrc as recrc


def plane(rng, shape=(2, 300, 2, 16), scale=1.0, dtype="bfloat16"):
    x = (rng.standard_normal(shape) * scale * rng.uniform(0.2, 3, shape[2:])).astype(np.float32)
    return from_float32(x, dtype)


def flags_of(data) -> int:
    return HEADER.unpack_from(data)[2]


def test_log_step_codes_round_up_within_one_code():
    steps = np.array([0.0, 1e-6, 1e-5, 0.013, 0.5, 1.0, 3.7, 1800.0], dtype=np.float32)
    codes = log_step_codes(steps)
    back = log_steps(codes)
    assert codes[0] == 0 and back[0] == 0.0
    assert (back[1:] >= steps[1:]).all()                        # never finer than chosen: the guard holds
    assert (back[1:] < steps[1:] * 2 ** (1 / LOG_STEP_RES) * 1.0001).all()
    for outside in (1e-7, 2000.0, np.inf, np.nan):               # a nonzero step outside the range: no codes
        assert log_step_codes(np.array([1.0, outside], dtype=np.float32)) is None


@pytest.mark.parametrize("name", list(LEVELS))
def test_compact_parameters_are_smaller_at_the_same_error(name):
    rng = np.random.default_rng(3)
    bits = plane(rng)
    info = PlaneInfo("bfloat16", bits.shape, "v", 0, 300)
    compact = get_codec(name)
    wide = EntropyQuantCodec(name, compact.codec_id, dataclasses.replace(compact.level, compact=False))
    a, b = bytes(compact.encode(bits, info)), bytes(wide.encode(bits, info))
    assert flags_of(a) & (FLAG_LOG_STEPS | FLAG_SHARED_CENTRE) == FLAG_LOG_STEPS | FLAG_SHARED_CENTRE
    assert flags_of(b) & (FLAG_LOG_STEPS | FLAG_SHARED_CENTRE) == 0
    params = [HEADER.unpack_from(d)[9] for d in (a, b)]
    assert params[0] < 0.6 * params[1]
    x = to_float32(bits, "bfloat16")
    err = [np.abs(to_float32(compact.decode(d, info), "bfloat16") - x).mean() for d in (a, b)]
    assert err[0] < 1.25 * err[1], err
    assert np.array_equal(compact.decode(b, info), wide.decode(b, info))    # the older payload still decodes


@pytest.mark.parametrize("scale", [1e4, 1e-7])
def test_steps_beyond_the_code_range_travel_as_floats(scale):
    """float16 above the range, float32 below it (float16 would flush such steps to zero)."""
    rng = np.random.default_rng(4)
    bits = plane(rng, scale=scale, dtype="float32")
    info = PlaneInfo("float32", bits.shape, "v", 0, 300)
    data = bytes(get_codec("q3e").encode(bits, info))
    assert not flags_of(data) & (FLAG_LOG_STEPS | FLAG_SHARED_CENTRE)
    assert flags_of(data) & FLAG_F32 == (FLAG_F32 if scale < 1 else 0)
    x = to_float32(bits, "float32")
    y = to_float32(get_codec("q3e").decode(data, info), "float32")
    assert np.abs(y - x).mean() < 0.3 * np.abs(x).mean()


def test_a_chunk_of_fine_tokens_only_keeps_its_own_centre():
    rng = np.random.default_rng(5)
    bits = plane(rng, shape=(1, 10, 2, 16))
    info = PlaneInfo("bfloat16", bits.shape, "k", 290, 300)       # the prompt's last 10: fine span only
    compact = get_codec("q3e")
    wide = EntropyQuantCodec("q3e", compact.codec_id, dataclasses.replace(compact.level, compact=False))
    data = bytes(compact.encode(bits, info))
    assert flags_of(data) & FLAG_LOG_STEPS and not flags_of(data) & FLAG_SHARED_CENTRE
    x = to_float32(bits, "bfloat16")
    err = [np.abs(to_float32(c.decode(c.encode(bits, info), info), "bfloat16") - x).mean() for c in (compact, wide)]
    assert err[0] <= 1.1 * err[1] + 1e-3, err


@pytest.mark.parametrize("flags", [FLAG_SHARED_CENTRE, FLAG_F32 | FLAG_LOG_STEPS, 16])
def test_inconsistent_flags_are_codec_errors(flags):
    rng = np.random.default_rng(6)
    bits = plane(rng)
    info = PlaneInfo("bfloat16", bits.shape, "v", 0, 300)
    data = bytearray(get_codec("q3e").encode(bits, info))
    data[2] = flags
    with pytest.raises(CodecError):
        get_codec("q3e").decode(recrc(bytes(data)), info)


def test_shared_centre_without_a_main_span_is_a_codec_error():
    """A forged payload: a fine-only chunk that claims a shared centre has no centre to share."""
    rng = np.random.default_rng(7)
    bits = plane(rng, shape=(1, 10, 2, 16))
    info = PlaneInfo("bfloat16", bits.shape, "v", 290, 300)
    data = bytearray(get_codec("q3e").encode(bits, info))
    data[2] |= FLAG_SHARED_CENTRE
    with pytest.raises(CodecError):
        get_codec("q3e").decode(recrc(bytes(data)), info)


def test_nibble_packing_round_trip():
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 1000):
        codes = rng.integers(0, 16, size=n, dtype=np.uint8)
        packed = pack_nibbles(codes)
        assert packed.size == (n + 1) // 2
        assert np.array_equal(unpack_nibbles(packed.tobytes(), n), codes)
        if n >= 2:
            assert packed[0] == codes[0] | (codes[1] << 4)


def test_a_frame_declaring_a_huge_size_is_refused_from_its_header():
    """zstd allocates a frame's declared content size before any output bound applies (a forged header
    declaring 50 GB raised MemoryError): the codes' frame of a q3e plane claiming 50 GB is a CodecError."""
    # magic, descriptor (8-byte content size, single segment), the size, one empty last raw block
    frame = b"\x28\xb5\x2f\xfd\xe0" + (50 << 30).to_bytes(8, "little") + b"\x01\x00\x00"
    rng = np.random.default_rng(8)
    bits = plane(rng, shape=(1, 64, 2, 16))
    info = PlaneInfo("bfloat16", bits.shape, "v", 0, 64)
    data = bytes(get_codec("q3e").encode(bits, info))
    fields = list(HEADER.unpack_from(data))
    body = data[HEADER.size:HEADER.size + fields[8] + fields[9]] + frame
    fields[10] = len(frame)
    with pytest.raises(CodecError, match="declares"):
        get_codec("q3e").decode(recrc(HEADER.pack(*fields) + body), info)


def test_non_finite_float16_parameters_are_codec_errors():
    """A forged (CRC fixed) centre of inf would decode to NaN KV: refused, as this encoder never sends one."""
    rng = np.random.default_rng(10)
    bits = plane(rng, shape=(1, 64, 2, 16))
    info = PlaneInfo("bfloat16", bits.shape, "v", 0, 64)
    data = bytearray(get_codec("q3e").encode(bits, info))
    e_len = HEADER.unpack_from(data)[8]
    data[HEADER.size + e_len:HEADER.size + e_len + 2] = np.float16(np.inf).tobytes()     # the first centre
    with pytest.raises(CodecError, match="non-finite"):
        get_codec("q3e").decode(recrc(bytes(data)), info)

