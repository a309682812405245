"""KV codecs on real KV from the bundled model, and on adversarial values."""

import numpy as np
import pytest
import torch

from edgecore.protocol.codecs import CODECS, PlaneInfo, from_float32, get_codec, to_float32
from edgecore.protocol.codecs.fp8 import encode_e4m3
from edgecore.protocol.errors import CodecError
from tests.conftest import make_engine


def bits_of(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float32:
        return t.numpy().view(np.uint32)
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def real_kv(request, heldout):
    engine = make_engine(dtype=request.param)
    ids = engine.tokenizer.encode(heldout)[:1000]
    engine.add_request("kv", ids, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    ks, vs = zip(*(engine.read_kv("kv", layer) for layer in range(engine.config.num_hidden_layers)))
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[request.param]
    return dtype, bits_of(torch.stack(ks)), bits_of(torch.stack(vs))


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
        bound = {"int8": 0.03, "fp8": 0.08, "int4": 0.4}[name]
        assert all(mean <= bound * scale for _, mean in per_layer), (name, kind, per_layer, scale)
        # First 4 and last 64 tokens are exact in the KIVI codecs.
        if name in ("int8", "int4"):
            assert np.array_equal(decoded[:, :4], plane[:, :4]) and np.array_equal(decoded[:, -64:], plane[:, -64:])
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
