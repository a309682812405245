"""The quantized KV pool (`--kv-cache-dtype int8|fp8`, shared/kv/quant_cache.py): values within their scale's
step, the pool's bytes, generation close to the float pool's, KV in and out (transfer, tier) through the same
quantization, and the flag's checks."""

import argparse

import pytest
import torch

from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.quant_cache import QuantCache
from edgecore.shared.models.config import CacheConfig
from tests.conftest import MODEL_DIR


def zeros(shape, dtype):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("kind, rel", [("int8", 0.5 / 127), ("fp8", 1 / 16)])
def test_values_come_back_within_their_step(kind, rel):
    torch.manual_seed(0)
    cache = QuantCache(16, 3, 32, kind, torch.float32, zeros)
    x = torch.randn(5, 3, 32) * torch.tensor([0.01, 1.0, 40.0]).view(1, 3, 1)     # heads of very different sizes
    slots = torch.tensor([1, 4, 7, 8, 15])
    cache.write(slots, x)
    got = cache.gather(slots)
    amax = x.abs().amax(-1, keepdim=True)
    assert ((got - x).abs() <= rel * amax * 1.01 + 1e-6).all()
    assert (cache.gather(torch.tensor([0, 2])) == 0).all()                 # never written: zeros
    blocks = cache.gather_blocks(torch.tensor([1, 0]), 8)                 # slots 8..15 then 0..7
    for row, i in ((0, 3), (7, 4), (9, 0), (12, 1), (15, 2)):          # slots 8, 15, 1, 4, 7
        torch.testing.assert_close(blocks[row], got[i])
    torch.testing.assert_close(cache.span(7, 2), got[2:4])
    cache.write(slots[:2], x[:2, 1:2] * 2, heads=slice(1, 2))           # one head range, as a TP core sends it
    torch.testing.assert_close(cache.gather(slots[:2])[:, 1:2], x[:2, 1:2] * 2, atol=rel * 2 * 40, rtol=0)
    cache.zero(slots)
    assert (cache.gather(slots) == 0).all()


def engine(kind=None, blocks=256):
    return LLMEngine.from_dir(MODEL_DIR, "fp32", "cpu", CacheConfig(num_blocks=blocks, kv_dtype=kind))


@pytest.fixture(scope="module")
def prompts(tokenizer, heldout):
    ids = tokenizer.encode(heldout)
    return [ids[i * 300:i * 300 + 120] for i in range(6)]


@pytest.fixture(scope="module")
def reference(prompts):
    return [r["token_ids"] for r in engine().generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                              ignore_eos=True))]


@pytest.mark.parametrize("kind, agree", [("int8", 0.9), ("fp8", 0.5)])
def test_generation_stays_close_to_the_float_pool(prompts, reference, kind, agree):
    eng = engine(kind)
    assert eng.pool.bytes / engine().pool.bytes == pytest.approx((1 + 2 / 32) / 4)   # ~3.8x the tokens of fp32
    got = [r["token_ids"] for r in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                         ignore_eos=True))]
    same = sum(a == b for x, y in zip(reference, got) for a, b in zip(x, y)) / sum(map(len, reference))
    assert same >= agree, same        # (positions after a first difference rarely agree: a lower bound)
    assert sum(x[:4] == y[:4] for x, y in zip(reference, got)) >= len(got) - 1


def test_kv_in_and_out_goes_through_the_quantization(prompts):
    """A transfer's slices (read_kv_slices on one engine, write_kv on another) land quantized, and the receiving
    engine continues as the sending one would."""
    src, dst = engine("int8"), engine("int8")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    src.add_request("p", prompts[0], params, prefill_only=True)
    while src.has_unfinished():
        src.step()
    dst.reserve("d", prompts[0], params)
    for piece in src.read_kv_slices("p", 0, len(prompts[0])):
        dst.write_kv("d", piece)
    first = src.get("p").token_ids[-1]
    dst.activate("d", first)
    out = []
    while dst.has_unfinished():
        out += dst.step()
    want = engine("int8").generate([prompts[0]], params)[0]["token_ids"]
    assert [t for o in out for t in o.new_token_ids] == want        # (activate's output carries the first token)


def test_the_flag_sets_the_pool_and_its_budget():
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.node.cli import kv_cache_config
    config = ModelConfig.from_dir(MODEL_DIR)

    def cache(kind):
        args = argparse.Namespace(kv_cache_memory="64MiB", kv_blocks=None, kv_cache_dtype=kind)
        return kv_cache_config(args, config, 2)
    (bf16, _), (int8, line) = cache("auto"), cache("int8")
    assert bf16.kv_dtype is None and int8.kv_dtype == "int8"
    assert int8.num_blocks == pytest.approx(bf16.num_blocks * 2 / (1 + 2 / 32), rel=0.01)   # ~1.9x the tokens
    assert "1.06 bytes per value" in line
    mla = ModelConfig.from_dir(MODEL_DIR)
    object.__setattr__(mla, "mla", object())
    with pytest.raises(ConfigError, match="MLA"):
        kv_cache_config(argparse.Namespace(kv_cache_memory="64MiB", kv_blocks=None, kv_cache_dtype="fp8"), mla, 2)
