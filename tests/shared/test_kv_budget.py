"""KV cache sizing from a memory budget, and a pool that becomes resident only as it is used."""

from pathlib import Path

import pytest
import torch

from edgecore.shared.models.config import CacheConfig, ModelConfig
from edgecore.shared.node.env import BUNDLED_MODEL
from edgecore.shared.kv.budget import bytes_per_token, describe, kv_blocks, parse_size
from edgecore.shared.kv.pool import KVPool


@pytest.mark.parametrize("text, value", [("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000),
                                         ("1000", 1000), (" 64 mib ", 64 << 20), ("3k", 3000)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "2 GiB of it", "-1GiB", "1e9", "0x10"])
def test_what_is_not_a_size_says_the_forms(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_blocks_from_the_model_dtype_and_ranks():
    config = ModelConfig.from_dir(BUNDLED_MODEL)       # 4 layers x K,V x 2 heads x 32 dims
    assert bytes_per_token(config, 4) == 4 * 2 * 2 * 32 * 4 == 2048
    assert kv_blocks(config, 4, 16, 64 << 20) == (64 << 20) // (16 * 2048) == 2048
    assert kv_blocks(config, 2, 16, 64 << 20) == 4096                 # bf16 halves a token's bytes
    assert kv_blocks(config, 4, 16, 64 << 20, tp=2) == 4096           # a rank holds one of the 2 KV heads
    assert kv_blocks(config, 4, 16, 64 << 20, tp=4) == 4096           # more ranks than heads: one head each
    assert kv_blocks(config, 4, 16, 16 * 2048 + 100) == 1             # whole blocks only
    with pytest.raises(ValueError, match="holds no block"):
        kv_blocks(config, 4, 16, 16 * 2048 - 1)
    assert "2048 blocks of 16 tokens = 32,768 tokens, 64.0 MiB" in describe(config, 4, 16, 2048)


@pytest.mark.parametrize("model", ["pydoc-llama", "pystd-mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_budget_counts_what_the_pool_allocates(model, dtype):
    """Per-head K/V and MLA's latent: a block as the budget counts it is a block as the pool holds it."""
    config = ModelConfig.from_dir(Path(__file__).resolve().parents[2] / "models" / model)
    pool = KVPool(config, CacheConfig(num_blocks=4), dtype, "cpu")
    assert pool.block_bytes == 16 * bytes_per_token(config, dtype.itemsize) == pool.bytes // 4
    if config.mla is not None:          # one latent per token, never split over tensor-parallel ranks
        assert bytes_per_token(config, 2, tp=2) == bytes_per_token(config, 2)


def resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_a_cpu_pool_is_zero_and_resident_only_where_written():
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    before = resident_kib()
    pool = KVPool(config, CacheConfig(num_blocks=16384), torch.float32, "cpu")    # 512 MiB of capacity
    assert resident_kib() - before < 16 << 10                  # far less than its 512 MiB stay unmapped
    slots = torch.arange(100, 116)
    k = torch.randn(16, 2, 32)
    pool.write(3, slots, k, -k)
    got_k, got_v = pool.read(3, torch.arange(96, 120))
    assert torch.equal(got_k[4:20], k) and torch.equal(got_v[4:20], -k)
    assert got_k[:4].abs().sum() == 0 and got_k[20:].abs().sum() == 0
    assert all(float(t[-16:].abs().sum()) == 0 for t in pool.k + pool.v)     # the far end reads as zeros


def test_the_engine_reports_its_memory_parts():
    from edgecore.shared.engine.sampling_params import SamplingParams
    from tests.conftest import make_engine
    engine = make_engine()
    stats = engine.stats()
    assert stats.weights_bytes >= sum(p.numel() * 4 for p in engine.model.parameters()) > 0
    assert stats.kv_block_bytes == 16 * 2048 and stats.blocks_touched == 0
    for _ in range(3):                      # the same 40-token request again and again: 3 blocks, reused
        engine.generate([list(range(3, 40))], SamplingParams(max_tokens=5))
    assert engine.stats().blocks_touched == 3
