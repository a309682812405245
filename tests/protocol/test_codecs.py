"""KV codecs on real KV from the bundled model, on random planes of every shape and dtype, and on
corrupted, truncated and fuzzed payloads."""

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgecore.protocol.codecs import CODECS, LEVELS, PlaneInfo, from_float32, get_codec, to_float32
from edgecore.protocol.codecs.equant import EXACT_HEAD, HEADER, token_spans
from edgecore.protocol.codecs.fp8 import encode_e4m3
from edgecore.protocol.codecs.quant import QuantCodec
from edgecore.protocol.errors import CodecError
from tests.conftest import make_engine

ENTROPY = list(LEVELS)
CONTAINERS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}
# Mean |error| / mean |x| allowed per codec on real KV (values are heavy-tailed: mean |x| ≈ 0.6 std; the
# entropy-coded levels spend few bits there, their quality is measured end to end in bench/kv_rd.py).
BOUNDS = {"int8": 0.03, "fp8": 0.08, "int4": 0.4, "q4e": 0.25, "q3e": 0.3, "q2e": 0.45}


def bits_of(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float32:
        return t.numpy().view(np.uint32)
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def real_kv(request, heldout):
    # The model runs in float32 (a bf16 engine needs AVX-512 or AVX-NE-CONVERT on CPU); its KV is rounded
    # to bf16 for the bf16 case, as a bf16 core would hold it.
    engine = make_engine(dtype="fp32")
    ids = engine.tokenizer.encode(heldout)[:1000]
    engine.add_request("kv", ids, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    ks, vs = zip(*(engine.read_kv("kv", layer) for layer in range(engine.config.num_hidden_layers)))
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[request.param]
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[request.param]
    return dtype, bits_of(torch.stack(ks).to(torch_dtype)), bits_of(torch.stack(vs).to(torch_dtype))


@pytest.mark.parametrize("name", list(CODECS))
def test_codecs_on_real_kv(real_kv, name):
    dtype, k, v = real_kv
    codec = get_codec(name)
    report = {}
    for kind, plane in (("k", k), ("v", v)):
        info = PlaneInfo(dtype, plane.shape, kind, 0, plane.shape[1])
        encoded = bytes(codec.encode(plane, info))
        decoded = codec.decode(encoded, info)
        assert decoded.dtype == plane.dtype and decoded.shape == plane.shape
        if codec.lossless:
            assert np.array_equal(decoded, plane)
            continue
        ref, got = to_float32(plane, dtype), to_float32(decoded, dtype)
        err = np.abs(got - ref)
        per_layer = [(float(err[i].max()), float(err[i].mean())) for i in range(plane.shape[0])]
        report[kind] = per_layer
        scale = float(np.abs(ref).mean())
        bound = BOUNDS[name]
        assert all(mean <= bound * scale for _, mean in per_layer), (name, kind, per_layer, scale)
        # First 4 and the last tokens (64 for KIVI, the level's `recent` for qNe) are exact.
        recent = LEVELS[name].recent if name in LEVELS else 64 if name in ("int8", "int4") else 0
        if recent:
            assert np.array_equal(decoded[:, :4], plane[:, :4])
            assert np.array_equal(decoded[:, -recent:], plane[:, -recent:])
    if report:
        print(name, dtype, report)


@pytest.mark.parametrize("dtype, container", [("bfloat16", np.uint16), ("float16", np.uint16),
                                              ("float32", np.uint32)])
def test_lossless_is_bit_exact_on_special_values(dtype, container):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, np.iinfo(container).max, size=(2, 33, 3, 8), dtype=np.uint64).astype(container)
    specials = {"bfloat16": [0x7FC0, 0x7F80, 0xFF80, 0x0001, 0x8000, 0x0000, 0xFFFF],
                "float16": [0x7E00, 0x7C00, 0xFC00, 0x0001, 0x8000, 0x0000, 0xFFFF],
                "float32": [0x7FC00000, 0x7F800000, 0xFF800000, 0x1, 0x80000000, 0, 0xFFFFFFFF]}[dtype]
    bits.reshape(-1)[: len(specials)] = specials
    codec = get_codec("lossless")
    info = PlaneInfo(dtype, bits.shape)
    assert np.array_equal(codec.decode(codec.encode(bits, info), info), bits)
    empty = np.zeros((1, 0, 2, 4), dtype=container)
    info0 = PlaneInfo(dtype, empty.shape)
    assert codec.decode(codec.encode(empty, info0), info0).shape == empty.shape


def test_e4m3_matches_torch_float8():
    x = torch.cat([torch.randn(5000) * 100, torch.tensor([0.0, -0.0, 448.0, -448.0, 1e-4, 2 ** -9, 3.3e-3])])
    ours = encode_e4m3(x.numpy())
    ref = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(ours, ref)


def test_bf16_rounding_matches_torch():
    x = torch.randn(10000) * 3
    ours = from_float32(x.numpy(), "bfloat16")
    assert np.array_equal(ours, x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_corrupt_encodings_raise_codec_error():
    bits = np.arange(2 * 100 * 2 * 8, dtype=np.uint16).reshape(2, 100, 2, 8)
    for name in CODECS:
        codec = get_codec(name)
        info = PlaneInfo("bfloat16", bits.shape, "k", 0, 100)
        enc = bytes(codec.encode(bits, info))
        for bad in (enc[:-3], enc + b"x", b""):
            with pytest.raises(CodecError):
                codec.decode(bad, info)
    with pytest.raises(CodecError, match="unknown KV codec"):
        get_codec("gzip")


def random_plane(rng, dtype: str, shape, outliers: bool = False) -> np.ndarray:
    """Gaussian KV-like values (per-channel scales, a few outlier channels) as raw bits of dtype."""
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.2, 2.0, size=shape[-1]).astype(np.float32)
    if outliers and shape[-1] > 2:
        x[..., 1] *= 20
    return from_float32(x, dtype)


@pytest.mark.parametrize("name", ENTROPY + ["int8", "int4", "lossless", "fp8"])
@pytest.mark.parametrize("dtype", list(CONTAINERS))
@pytest.mark.parametrize("shape, token_start, total", [
    ((3, 301, 2, 32), 0, 301),      # odd token count, the whole prompt
    ((1, 1, 4, 64), 0, 1),          # one-token prompt
    ((2, 1, 2, 16), 150, 400),      # one-token chunk in the middle of a prompt (quantized)
    ((2, 1, 2, 16), 399, 400),      # one-token chunk at the end (exact)
    ((2, 77, 3, 8), 100, 0),        # total unknown: the chunk ends the prompt
    ((4, 600, 1, 24), 2, 900),      # several groups, the last one short; starts inside the sinks
])
def test_round_trip_random(name, dtype, shape, token_start, total):
    rng = np.random.default_rng(7)
    bits = random_plane(rng, dtype, shape, outliers=True)
    codec = get_codec(name)
    for kind in "kv":
        info = PlaneInfo(dtype, shape, kind, token_start, total)
        out = codec.decode(bytes(codec.encode(bits, info)), info)
        assert out.dtype == bits.dtype and out.shape == bits.shape
        if codec.lossless:
            assert np.array_equal(out, bits)
            continue
        x, y = to_float32(bits, dtype), to_float32(out, dtype)
        assert np.isfinite(y).all()
        rel = float(np.abs(x - y).mean() / np.abs(x).mean())
        assert rel < {"q2e": 0.35, "q3e": 0.25, "q4e": 0.2, "int4": 0.4, "int8": 0.03, "fp8": 0.08}[name], rel
        if name in LEVELS:
            a, _, c = token_spans(info, LEVELS[name])
            assert np.array_equal(out[:, :a], bits[:, :a]) and np.array_equal(out[:, c:], bits[:, c:])
            assert a == max(0, min(shape[1], EXACT_HEAD - token_start))


@pytest.mark.parametrize("name", ENTROPY)
def test_entropy_levels_order_by_size_and_error(name):
    """On the same plane, each coarser level is smaller and less exact than the finer one."""
    rng = np.random.default_rng(3)
    bits = random_plane(rng, "bfloat16", (4, 2000, 2, 32))
    info = PlaneInfo("bfloat16", bits.shape, "k", 0, 2000)
    sizes, errors = [], []
    for level in ENTROPY:
        codec = get_codec(level)
        data = bytes(codec.encode(bits, info))
        sizes.append(len(data))
        errors.append(float(np.abs(to_float32(codec.decode(data, info), "bfloat16") - to_float32(bits, "bfloat16")).mean()))
    assert sizes == sorted(sizes, reverse=True) and errors == sorted(errors)
    assert sizes[-1] < 0.2 * bits.nbytes      # q2e on Gaussian data: well under 3.2 bits per value


def test_constant_and_extreme_planes():
    """Zero variance (step 0), huge values (float32 parameters) and float16 limits decode finite and close."""
    for dtype, values in (("bfloat16", [0.0, 3.0]), ("float32", [1e30, -1e30]), ("float16", [60000.0, -0.5])):
        for v in values:
            x = np.full((2, 300, 2, 8), v, dtype=np.float32)
            x[:, ::7] *= 1.01
            bits = from_float32(x, dtype)
            for name in ENTROPY:
                info = PlaneInfo(dtype, bits.shape, "v", 0, 300)
                y = to_float32(get_codec(name).decode(get_codec(name).encode(bits, info), info), dtype)
                assert np.isfinite(y).all()
                assert np.abs(y - to_float32(bits, dtype)).max() <= 0.02 * abs(v) + 1e-6, (dtype, v, name)


@pytest.mark.parametrize("dtype, top", [("float16", 65504.0), ("float16", 62000.0)])
def test_finite_values_near_the_dtype_limit_never_decode_to_infinity(dtype, top):
    """A group's centre plus its largest offset can pass the dtype's range (q4e put -62000 at -66532 in
    float16, an infinity): every lossy codec clamps a float16 reconstruction to the finite range. (Not covered:
    groups spanning more than float32's range, ±3e38 together, whose parameters overflow.)"""
    rng = np.random.default_rng(0)
    x = rng.uniform(-top, top, (2, 64, 2, 16)).astype(np.float32)
    x[:, ::5, :, ::3] = -top
    x[:, 1::5, :, 1::3] = top
    bits = from_float32(x, dtype)
    assert np.isfinite(to_float32(bits, dtype)).all()
    for name in [c for c in CODECS if not get_codec(c).lossless]:
        for kind in ("k", "v"):
            info = PlaneInfo(dtype, bits.shape, kind, 0, 64)
            y = to_float32(get_codec(name).decode(get_codec(name).encode(bits, info), info), dtype)
            assert np.isfinite(y).all(), (name, kind)


def test_column_and_row_reductions_match_numpy():
    """The codecs' fast statistics (columns.py) equal numpy's reductions on every shape they meet."""
    from edgecore.protocol.codecs.columns import column_mean_std, column_reduce, row_reduce
    rng = np.random.default_rng(5)
    for layers, n, width in ((1, 1, 3), (1, 17, 64), (2, 31, 8), (1, 976, 64), (3, 128, 5), (2, 1000, 1)):
        rows = (rng.standard_normal((layers, n, width)) * rng.uniform(0.1, 30, width) + 5).astype(np.float32)
        for op in (np.maximum, np.minimum):
            assert np.array_equal(column_reduce(op, rows), op.reduce(rows, axis=1))
            flat = rows.reshape(-1, width)
            assert np.array_equal(row_reduce(op, flat), op.reduce(flat, axis=1))
        mean, std = column_mean_std(rows)
        assert np.allclose(mean, rows.mean(axis=1), rtol=1e-5, atol=1e-4)
        assert np.allclose(std, rows.astype(np.float64).std(axis=1), rtol=1e-3, atol=1e-3)
    huge = np.full((1, 40, 4), 1e30, dtype=np.float32)
    huge[:, ::3] *= 1.5                         # squares overflow float32: redone in float64
    assert np.allclose(column_mean_std(huge)[1], huge.astype(np.float64).std(axis=1), rtol=1e-5)


@pytest.mark.parametrize("name", ENTROPY)
def test_biased_channel_keeps_its_codes_in_range(name):
    """A channel far from zero with a tiny spread (|centre / step| in the thousands, where float32 cancellation
    can push a code past 0..15) decodes close: codes never wrap."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 300, 2, 16)).astype(np.float32)
    x[..., 3] = 3000.0 + rng.standard_normal((1, 300, 2)) * 0.01
    x[..., 5] = -250.0 + rng.standard_normal((1, 300, 2)) * 0.5
    bits = from_float32(x, "float32")
    info = PlaneInfo("float32", bits.shape, "v", 0, 300)
    codec = get_codec(name)
    y = to_float32(codec.decode(codec.encode(bits, info), info), "float32")
    err = np.abs(y - x)
    assert err[..., 3].max() < 0.05 and err[..., 5].max() < 1.0
    assert err.mean() < 0.3


@pytest.mark.parametrize("name", ENTROPY)
def test_entropy_level_detects_any_corruption(name):
    """Every flipped byte, cut or added byte raises CodecError: the body carries a CRC-32."""
    rng = np.random.default_rng(5)
    bits = random_plane(rng, "bfloat16", (2, 200, 2, 16))
    info = PlaneInfo("bfloat16", bits.shape, "k", 0, 200)
    enc = bytes(get_codec(name).encode(bits, info))
    for pos in list(range(0, len(enc), max(1, len(enc) // 97))) + [len(enc) - 1]:
        bad = bytearray(enc)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(CodecError):
            get_codec(name).decode(bytes(bad), info)
    for bad in (enc[:-1], enc[:HEADER.size], enc[:5], enc + b"\0"):
        with pytest.raises(CodecError):
            get_codec(name).decode(bad, info)
    with pytest.raises(CodecError):    # decoded against another shape
        get_codec(name).decode(enc, PlaneInfo("bfloat16", (2, 201, 2, 16), "k", 0, 201))


def _recrc(data: bytes) -> bytes:
    """The payload with its header's CRC recomputed (a forged, internally consistent payload)."""
    head = data[:HEADER.size - 4]
    return head + zlib.crc32(data[HEADER.size:], zlib.crc32(head)).to_bytes(4, "little") + data[HEADER.size:]


_FUZZ_INFO = PlaneInfo("bfloat16", (2, 40, 2, 8), "v", 0, 40)
_FUZZ_BITS = random_plane(np.random.default_rng(9), "bfloat16", _FUZZ_INFO.shape)
_FUZZ_SEEDS = {name: bytes(get_codec(name).encode(_FUZZ_BITS, _FUZZ_INFO)) for name in CODECS}


def _decode_or_codec_error(name: str, data: bytes, info: PlaneInfo = _FUZZ_INFO):
    try:
        out = get_codec(name).decode(data, info)
    except CodecError:
        return None
    assert out.shape == info.shape and out.dtype == np.uint16
    return out


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(list(CODECS)), data=st.binary(max_size=600))
def test_fuzz_decoder_random_bytes(name, data):
    _decode_or_codec_error(name, data)


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(ENTROPY), edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                                     min_size=1, max_size=4), cut=st.integers(0, 40),
       forge=st.booleans())
def test_fuzz_decoder_mutated(name, edits, cut, forge):
    """Mutated valid payloads: CodecError, or (with a forged CRC) a plane of the right shape — never
    another exception."""
    data = bytearray(_FUZZ_SEEDS[name])
    for pos, value in edits:
        data[pos % len(data)] = value
    data = bytes(data[:len(data) - cut]) if cut < len(data) else bytes(data)
    if forge and len(data) >= HEADER.size:
        _decode_or_codec_error(name, _recrc(data))
    elif bytes(data) != _FUZZ_SEEDS[name]:
        with pytest.raises(CodecError):
            get_codec(name).decode(data, _FUZZ_INFO)


def test_rotate_matches_the_model_rope():
    from edgecore.protocol.codecs.equant import rotate
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
    from tests.conftest import MODEL_DIR
    from edgecore.shared.kv.wire import codec_rope
    config = ModelConfig.from_dir(MODEL_DIR)
    inv_freq, _scale = rope_inv_freq(config)
    rope = codec_rope(config)        # what core and edge hand the codecs on the live path
    assert rope == tuple(float(f) for f in inv_freq.double())
    x = torch.randn(300, 2, config.head_dim)
    cos, sin = rope_cos_sin(config, 400)
    ref = apply_rope(x, cos[100:400, None], sin[100:400, None])
    ours = rotate(x.numpy()[None], rope, 100, inverse=False)[0]
    assert np.allclose(ours, ref.numpy(), atol=1e-4)     # the model's angles are float32, ours float64
    assert np.allclose(rotate(ours[None], rope, 100, inverse=True)[0], x.numpy(), atol=1e-5)

    # No rotate-half keys over the full head_dim: MLA's latent plane, Llama 4's adjacent pairs.
    import dataclasses
    assert codec_rope(dataclasses.replace(config, mla=object())) is None
    assert codec_rope(dataclasses.replace(config, architecture="Llama4ForCausalLM")) is None


@pytest.mark.parametrize("name", ENTROPY)
def test_keys_with_rope_removed(name):
    """Keys rotated by RoPE code smaller and closer with the rotation removed; the decoder needs the RoPE."""
    rng = np.random.default_rng(11)
    rope = tuple(1.0 / 10000 ** (np.arange(0, 32, 2) / 32))
    pre = rng.standard_normal((2, 500, 2, 32)).astype(np.float32) * 0.3 + rng.standard_normal(32).astype(np.float32)
    from edgecore.protocol.codecs.equant import rotate
    bits = from_float32(rotate(pre, rope, 40, inverse=False), "bfloat16")
    codec = get_codec(name)
    plain = PlaneInfo("bfloat16", bits.shape, "k", 40, 540)
    with_rope = PlaneInfo("bfloat16", bits.shape, "k", 40, 540, rope=rope)
    results = []
    for info in (plain, with_rope):
        data = bytes(codec.encode(bits, info))
        err = np.abs(to_float32(codec.decode(data, info), "bfloat16") - to_float32(bits, "bfloat16")).mean()
        results.append((len(data), err))
    (size0, err0), (size1, err1) = results
    assert size1 < size0 and err1 < err0, results
    with pytest.raises(CodecError, match="RoPE"):
        codec.decode(bytes(codec.encode(bits, with_rope)), plain)


def test_kv_chunk_with_rope_round_trip():
    """encode_chunk/decode_chunk carry the RoPE through to the codec; a decoder without it fails cleanly."""
    from edgecore.protocol.kv import decode_chunk, encode_chunk
    rng = np.random.default_rng(2)
    rope = tuple(1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
    k, v = random_plane(rng, "bfloat16", (2, 300, 2, 16)), random_plane(rng, "bfloat16", (2, 300, 2, 16))
    data = encode_chunk("r", k, v, layer_start=1, token_start=0, dtype="bfloat16", codec="q3e", total_tokens=300,
                        rope=rope)
    k2, v2 = decode_chunk(data, rope=rope)
    assert k2.shape == k.shape and np.abs(to_float32(k2, "bfloat16") - to_float32(k, "bfloat16")).mean() < 0.2
    with pytest.raises(CodecError, match="RoPE"):
        decode_chunk(data)


THREADED = ENTROPY + ["int8", "int4"]     # the codecs whose temporaries are per-thread scratch arrays


def test_entropy_levels_from_many_threads():
    """Core and edge code chunks in worker threads: concurrent encodes and decodes stay correct."""
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(4)
    rope = tuple(1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
    jobs = [(random_plane(rng, "bfloat16", (1, 50 + i, 2, 16)), 7 * i) for i in range(24)]

    def work(job):
        bits, start = job
        info = PlaneInfo("bfloat16", bits.shape, "k", start, 0, 0, rope)
        codec = get_codec(THREADED[start % len(THREADED)])
        data = bytes(codec.encode(bits, info))
        return data, codec.decode(data, info)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, jobs * 3))
    for (bits, start), (data, out) in zip(jobs * 3, results):
        info = PlaneInfo("bfloat16", bits.shape, "k", start, 0, 0, rope)
        assert np.array_equal(out, get_codec(THREADED[start % len(THREADED)]).decode(data, info))
        assert np.abs(to_float32(out, "bfloat16") - to_float32(bits, "bfloat16")).mean() < 0.3


@pytest.mark.parametrize("name", ENTROPY)
def test_unknown_format_version_is_a_codec_error(name):
    """A payload of another format version (a newer peer's) is refused, never decoded as this one."""
    data = bytearray(_FUZZ_SEEDS[name])
    data[0] = 2
    with pytest.raises(CodecError, match="version 2"):
        get_codec(name).decode(_recrc(bytes(data)), _FUZZ_INFO)


def test_int8_zstd_level_is_the_encoders_choice(real_kv):
    """int8's fast zstd frames and an older core's level-1 ones decode alike; the fast ones are < 5% larger."""
    dtype, k, v = real_kv
    older, codec = QuantCodec(8, "int8", 3, zstd_level=1), get_codec("int8")
    sizes = np.zeros(2)
    for kind, plane in (("k", k), ("v", v)):
        info = PlaneInfo(dtype, plane.shape, kind, 0, plane.shape[1], 0)
        slow, fast = older.encode(plane, info), codec.encode(plane, info)
        sizes += (len(slow), len(fast))
        assert np.array_equal(codec.decode(slow, info), older.decode(fast, info))
    assert sizes[0] < sizes[1] < 1.05 * sizes[0]
