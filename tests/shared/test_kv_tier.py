"""The disk KV tier (shared/kv/tier.py, shared/engine/tier_loads.py): evicted prefix-cache blocks spill to a
directory and are read back instead of recomputed, by the same engine or a restarted one; a corrupted,
truncated or foreign file is a miss (recomputed, identical tokens) and is removed; the size bound holds;
salts and models never share blocks; a directory that fails keeps the engine serving; a writer that is behind
drops spills instead of blocking."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv import tier as tier_mod
from edgecore.shared.kv.tier import BlockShape, KVTier, tier_key
from tests.conftest import MODEL_DIR

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BLOCKS = 24                 # 384 tokens of pool: three 96-token prompts and their outputs evict each other
CAPACITY = 8 << 20


def prompt(i: int, n: int = 96) -> list[int]:
    return [(7 * i + 13 * j) % 1900 + 50 for j in range(n)]


def engine(tier_dir: Path | None, num_blocks: int = BLOCKS, capacity: int = CAPACITY,
           fingerprint: str | None = None) -> LLMEngine:
    cache = CacheConfig(num_blocks=num_blocks, tier_dir=str(tier_dir) if tier_dir else None, tier_bytes=capacity)
    eng = LLMEngine.from_dir(MODEL_DIR, "fp32", "cpu", cache, EngineConfig())
    if fingerprint is not None:      # the same weights under another model fingerprint
        eng2 = LLMEngine(eng.model, eng.config, eng.tokenizer, cache, EngineConfig(), fingerprint)
        eng.close()
        return eng2
    return eng


def run(eng: LLMEngine, ids: list[int], salt: str | None = None, rid: str = "r") -> tuple[list[int], int]:
    """Token ids generated and the cached prompt tokens the outputs report."""
    eng.add_request(rid, ids, GREEDY, cache_salt=salt)
    tokens: list[int] = []
    cached = -1
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens if cached < 0 else cached
    return tokens, cached


@pytest.fixture(scope="module")
def baseline() -> dict[int, list[int]]:
    eng = engine(None, num_blocks=256)
    out = {i: run(eng, prompt(i), rid=f"b{i}")[0] for i in range(4)}
    return out


def fill(tier_dir: Path, salt: str | None = None, prompts: range = range(4)) -> None:
    eng = engine(tier_dir)
    for i in prompts:
        run(eng, prompt(i), salt, rid=f"f{i}")
    eng.close()


def files(tier_dir: Path) -> list[Path]:
    return sorted(tier_dir.glob("*.kvb"))


def test_a_restarted_engine_serves_its_previous_prefixes_from_the_tier(tmp_path, baseline):
    fill(tmp_path)
    assert files(tmp_path)
    eng = engine(tmp_path)
    assert eng.stats().tier_files == len(files(tmp_path))        # the index, rebuilt from the directory
    tokens, cached = run(eng, prompt(0))
    s = eng.stats()
    assert tokens == baseline[0]
    assert s.tier_hit_blocks == 5 and cached == 80               # 95 tokens looked up: 5 full blocks
    assert s.tier_read_bytes > 0 and s.tier_read_seconds > 0
    assert s.prefix_cache_hit_tokens == 80
    eng.close()


def test_blocks_evicted_while_running_come_back_from_the_tier(tmp_path, baseline):
    eng = engine(tmp_path)
    for i in range(5):
        run(eng, prompt(i), rid=f"a{i}")
    assert eng.stats().tier_written_blocks > 0                  # prompt 0 was evicted by the later ones
    assert eng.block_manager.match_prefix(prompt(0)) == []
    assert eng.cached_prefix(prompt(0)) == 80                    # pool or tier: counted without reading
    tokens, cached = run(eng, prompt(0), rid="again")
    assert tokens == baseline[0] and cached == 80 and eng.stats().tier_hit_blocks == 5
    eng.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty"])
def test_a_bad_file_is_a_miss_recomputed_and_removed(tmp_path, baseline, damage):
    fill(tmp_path, prompts=range(1))
    eng = engine(tmp_path)
    first = tmp_path / (tier_key(eng.tier.tier.fingerprint, _first_hash(eng, prompt(0)), None).hex() + ".kvb")
    assert first.is_file()
    others = [f for f in files(tmp_path) if f != first]
    data = first.read_bytes()
    if damage == "flip":
        first.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:])
    elif damage == "truncate":
        first.write_bytes(data[:len(data) - 100])
    elif damage == "foreign":             # a whole, valid file of another block under this block's name
        first.write_bytes(others[0].read_bytes())
    else:
        first.write_bytes(b"")
    tokens, cached = run(eng, prompt(0))
    s = eng.stats()
    assert tokens == baseline[0]
    assert cached == 0 and s.tier_hit_blocks == 0 and s.tier_removed_files == 1
    assert not first.exists()
    eng.close()


def _first_hash(eng: LLMEngine, ids: list[int]) -> int:
    from edgecore.shared.kv.block_manager import prefix_hashes
    return prefix_hashes(ids, eng.block_manager.block_size, len(ids) - 1)[0]


def test_the_size_bound_holds_under_many_prompts(tmp_path):
    cap = 300_000                           # ≈ 9 blocks of this model (32 KiB raw, about 29 KiB lossless)
    eng = engine(tmp_path, num_blocks=12, capacity=cap)
    for i in range(12):
        run(eng, prompt(i, 64), rid=f"p{i}")
        assert eng.stats().tier_used_bytes <= cap
    eng.close()
    on_disk = sum(f.stat().st_size for f in files(tmp_path))
    assert 0 < on_disk <= cap
    reopened = KVTier(tmp_path, cap, "x", BlockShape(4, 16, 2, 32, 32, "float32"))     # the index from the listing
    assert reopened.counters.used_bytes == on_disk and reopened.counters.files == len(files(tmp_path))
    reopened.close()
    small = KVTier(tmp_path, cap // 3, "x", BlockShape(4, 16, 2, 32, 32, "float32"))   # restarted smaller
    assert small.counters.used_bytes <= cap // 3
    assert sum(f.stat().st_size for f in files(tmp_path)) <= cap // 3
    small.close()


def test_salts_and_models_never_share_tier_blocks(tmp_path, baseline):
    fill(tmp_path, salt="tenant-a", prompts=range(1))
    eng = engine(tmp_path)
    assert run(eng, prompt(0), "tenant-b", rid="b") == (baseline[0], 0)
    assert run(eng, prompt(0), None, rid="none") == (baseline[0], 0)
    assert eng.stats().tier_hit_blocks == 0
    assert run(eng, prompt(0), "tenant-a", rid="a") == (baseline[0], 80)
    eng.close()
    other = engine(tmp_path, fingerprint="another-model")
    assert run(other, prompt(0), "tenant-a", rid="a") == (baseline[0], 0)
    assert other.stats().tier_hit_blocks == 0
    other.close()


@pytest.mark.parametrize("failure", ["read-only", "full", "deleted"])
def test_a_failing_directory_keeps_the_engine_serving(tmp_path, baseline, monkeypatch, caplog, failure):
    tier_dir = tmp_path / "tier"
    eng = engine(tier_dir)
    if failure in ("read-only", "full"):      # (tests run as root, which a chmod does not stop)
        code = errno.EROFS if failure == "read-only" else errno.ENOSPC

        def refuse(src: object, dst: object) -> None:
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(tier_mod.os, "replace", refuse)
    else:
        for f in tier_dir.iterdir():
            f.unlink()
        tier_dir.rmdir()
    caplog.set_level(logging.WARNING, logger="edgecore.shared.kv.tier")
    for i in range(4):
        assert run(eng, prompt(i), rid=f"p{i}")[0] == baseline[i]
    eng.tier.close()                # (drains the writer: every queued spill has failed by now)
    s = eng.stats()
    assert s.tier_errors > 0 and not s.tier_healthy and s.tier_written_blocks == 0 and s.tier_dropped_blocks > 0
    assert sum("keeps serving" in r.getMessage() for r in caplog.records) == 1
    eng.tier = None


def test_a_writer_behind_drops_spills_instead_of_waiting(tmp_path, monkeypatch):
    gate = threading.Event()
    real = KVTier._write
    monkeypatch.setattr(KVTier, "_write", lambda self, item: (gate.wait(30), real(self, item)))
    tier = KVTier(tmp_path, CAPACITY, "fp", BlockShape(2, 4, 1, 8, 8, "float32"), queue_blocks=2)
    k = torch.randn(2, 4, 1, 8)
    accepted = [tier.spill(tier.key(h, None), h, k, k) for h in range(6)]
    assert accepted.count(False) >= 3 and tier.counters.dropped_blocks == accepted.count(False)
    gate.set()
    tier.close()
    assert tier.counters.written_blocks == accepted.count(True) == len(files(tmp_path))


def test_a_full_disk_evicts_no_block(tmp_path, monkeypatch):
    """The new block's file is written before least recently used ones make room: a write that fails (ENOSPC)
    keeps the blocks there."""
    shape = BlockShape(2, 4, 1, 8, 8, "float32")
    k = torch.randn(2, 4, 1, 8)
    tier = KVTier(tmp_path, CAPACITY, "fp", shape)
    assert tier.spill(tier.key(1, None), 1, k, k)
    tier.close()
    size = files(tmp_path)[0].stat().st_size
    tier = KVTier(tmp_path, 2 * size, "fp", shape)      # room for two blocks
    assert tier.spill(tier.key(2, None), 2, k, k)
    real_open = open

    def full(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, *args, **kwargs)

    tier.close()
    tier = KVTier(tmp_path, 2 * size, "fp", shape)
    monkeypatch.setattr(tier_mod, "open", full, raising=False)
    assert tier.spill(tier.key(3, None), 3, k, k)
    tier.close()
    assert tier.counters.dropped_blocks == 1 and not tier.counters.healthy
    assert len(files(tmp_path)) == 2 and tier.has(tier.key(1, None)) and tier.has(tier.key(2, None))
    monkeypatch.undo()
    tier = KVTier(tmp_path, 2 * size, "fp", shape)      # and once writes succeed, the bound holds as before
    assert tier.spill(tier.key(3, None), 3, k, k)
    tier.close()
    assert len(files(tmp_path)) == 2 and tier.has(tier.key(3, None)) and not tier.has(tier.key(1, None))


def test_a_block_round_trips_bit_exact_and_only_under_its_own_key(tmp_path):
    shape = BlockShape(3, 16, 2, 8, 8, "bfloat16")
    tier = KVTier(tmp_path, CAPACITY, "fp", shape)
    k, v = torch.randn(3, 16, 2, 8).bfloat16(), torch.randn(3, 16, 2, 8).bfloat16()
    key = tier.key(42, "s")
    assert tier.spill(key, 42, k, v)
    tier.close()
    tier = KVTier(tmp_path, CAPACITY, "fp", shape)
    assert tier.has(key) and not tier.has(tier.key(42, None)) and not tier.has(tier.key(43, "s"))
    [(k2, v2)] = tier.load([(key, 42)]).result()
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert tier.load([(key, 43)]).result() == []          # the right name, the wrong hash inside: removed
    assert not tier.has(key) and not files(tmp_path)
    tier.close()


def test_an_abort_while_loading_releases_everything(tmp_path):
    fill(tmp_path, prompts=range(1))
    eng = engine(tmp_path)
    eng.add_request("x", prompt(0), GREEDY)
    assert eng.tier.loading == 1 and eng.stats().waiting == 1
    assert eng.abort("x")
    assert not eng.has_unfinished() and eng.tier.loading == 0
    assert eng.block_manager.num_used == 0
    eng.close()


def test_a_refused_reservation_drops_its_prefetched_blocks(tmp_path):
    from edgecore.shared.errors import RequestError
    fill(tmp_path, prompts=range(1))
    eng = engine(tmp_path)
    future = eng.prefetch_prefix("r", prompt(0))
    assert future is not None
    future.result(timeout=30)
    with pytest.raises(RequestError, match="maximum context length"):       # refused by _new_sequence
        eng.reserve("r", prompt(0), SamplingParams(max_tokens=10 ** 6))
    assert not eng.tier.pins and not eng.tier.loads and eng.block_manager.num_used == 0
    eng.add_request("x", prompt(0), GREEDY)          # a live request reading its prefix...
    assert eng.tier.loading == 1
    with pytest.raises(RequestError, match="already in use"):
        eng.reserve("x", prompt(0), GREEDY)
    assert eng.tier.loading == 1                    # ...keeps its load when a reservation reuses its id
    assert eng.abort("x") and eng.block_manager.num_used == 0
    eng.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a pool in accelerator memory"))])
def test_spilled_blocks_wait_for_the_writer_in_host_memory(tmp_path, device):
    """The writer's queue (up to 256 blocks) must not hold accelerator memory outside the pool's KV budget."""
    cache = CacheConfig(num_blocks=BLOCKS, tier_dir=str(tmp_path), tier_bytes=CAPACITY)
    eng = LLMEngine.from_dir(MODEL_DIR, "fp32", device, cache, EngineConfig())
    assert eng.tier is not None
    spilled, real = [], eng.tier.tier.spill

    def spy(key, block_hash, k, v, wait=0.0):
        spilled.append((k.device.type, v.device.type))
        real(key, block_hash, k, v, wait)

    eng.tier.tier.spill = spy
    for i in range(4):
        run(eng, prompt(i), rid=f"s{i}")
    eng.close()
    assert spilled and set(spilled) == {("cpu", "cpu")}


def test_a_remote_prefill_reports_the_prefilling_nodes_cached_tokens():
    eng = engine(None)
    ids = prompt(0)
    _, edge_cached = eng.reserve("x", ids, GREEDY)
    assert edge_cached == 0
    eng.activate("x", 5, cached_tokens=48)          # PrefillDone.cached_tokens, through FirstToken
    outs = [o for _ in range(3) for o in eng.step()]
    assert outs and {o.num_cached_tokens for o in outs} == {48}
    eng.abort("x")


def test_the_tier_is_exported_as_metrics_only_where_there_is_one():
    from prometheus_client import CollectorRegistry, generate_latest

    from edgecore.shared.engine.handle import EngineStats
    from edgecore.shared.node.metrics import EngineCollector

    def scrape(stats: EngineStats) -> str:
        registry = CollectorRegistry()
        registry.register(EngineCollector("m", lambda: stats, 16))
        return generate_latest(registry).decode()
    assert "kv_tier" not in scrape(EngineStats())
    text = scrape(EngineStats(tier_capacity_bytes=1000, tier_used_bytes=600, tier_hit_blocks=3, tier_healthy=False))
    assert 'edgecore:kv_tier_hit_blocks_total{model_name="m"} 3.0' in text
    assert 'edgecore:kv_tier_used_bytes{model_name="m"} 600.0' in text
    assert 'edgecore:kv_tier_healthy{model_name="m"} 0.0' in text
    for name in ("miss_blocks_total", "read_bytes_total", "read_seconds_total", "written_bytes_total",
                 "dropped_blocks_total", "errors_total", "removed_files_total", "capacity_bytes", "files"):
        assert f"edgecore:kv_tier_{name}{{" in text


def test_the_tier_flags_become_the_cache_config_and_bad_values_are_one_line_errors(tmp_path):
    from argparse import Namespace

    from edgecore.edge.settings import EdgeSettings
    from edgecore.shared.node.cli import kv_cache_config, kv_cache_memory
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.node.settings import namespace

    config = ModelConfig.from_dir(MODEL_DIR)
    base = namespace(EdgeSettings())
    assert kv_cache_config(base, config, 4)[0].tier_dir is None
    args = Namespace(**{**vars(base), "kv_tier_dir": str(tmp_path), "kv_tier_size": "3M"})
    cache = kv_cache_config(args, config, 4)[0]
    assert (cache.tier_dir, cache.tier_bytes, cache.tier_codec) == (str(tmp_path), 3_000_000, "lossless")
    for key, bad, says in (("kv_tier_size", "lots", "--kv-tier-size"), ("kv_tier_size", "0", "more than 0"),
                           ("kv_tier_codec", "zip", "--kv-tier-codec")):
        with pytest.raises(ConfigError, match=says):
            kv_cache_memory(Namespace(**{**vars(args), key: bad}))      # the edge's front process checks it


def test_the_engine_steps_on_while_a_prefix_is_read_from_disk(tmp_path, baseline, monkeypatch):
    fill(tmp_path, prompts=range(1))
    gate = threading.Event()
    real = KVTier._load
    monkeypatch.setattr(KVTier, "_load", lambda self, blocks: (gate.wait(30), real(self, blocks))[1])
    eng = engine(tmp_path)
    eng.add_request("slow", prompt(0), GREEDY)         # its prefix is on disk: it waits for the reader
    eng.add_request("other", prompt(1), GREEDY)        # nothing on disk: runs at once
    tokens: dict[str, list[int]] = {"slow": [], "other": []}
    cached: dict[str, int] = {}
    finished: set[str] = set()

    def step() -> None:
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            cached.setdefault(out.request_id, out.num_cached_tokens)
            if out.finished:
                finished.add(out.request_id)
    while "other" not in finished:
        step()
    assert finished == {"other"} and eng.tier.loading == 1 and tokens["slow"] == []
    gate.set()
    while eng.has_unfinished():
        step()
    assert tokens == {"slow": baseline[0], "other": baseline[1]} and cached["slow"] == 80
    eng.close()


async def test_a_reservation_takes_the_tiers_blocks_as_its_cached_prefix(tmp_path):
    from edgecore.shared.engine.engine_thread import EngineThread
    from edgecore.shared.engine.handle import EngineRequest

    fill(tmp_path, prompts=range(1))
    handle = EngineThread(engine(tmp_path))
    handle.start()
    await handle.started()
    try:
        assert await handle.reserve(EngineRequest("r", prompt(0), GREEDY), None) == 80   # the core sends the rest
        assert await handle.reserve(EngineRequest("s", prompt(1), GREEDY), None) == 0    # nothing on disk
        s = handle.stats()
        assert s.tier_hit_blocks == 5 and s.awaiting_kv == 2
        handle.release("r")
        handle.release("s")
        await handle.cached_prefix([1])             # (a turn of the engine thread: the releases are done)
        assert handle.stats().blocks_used == 0 and not handle.engine.tier.pins
    finally:
        handle.stop()


def test_a_quantized_engine_never_reads_blocks_of_the_float_weights(tmp_path):
    """`--quantize` computes other KV from the same checkpoint: the tier's keys tell the modes apart."""
    fill(tmp_path, prompts=range(1))
    cache = CacheConfig(num_blocks=BLOCKS, tier_dir=str(tmp_path), tier_bytes=CAPACITY)
    eng = LLMEngine.from_dir(MODEL_DIR, "fp32", "cpu", cache, EngineConfig(quantize="int8"))
    assert run(eng, prompt(0), rid="q")[1] == 0
    assert eng.stats().tier_hit_blocks == 0 and eng.stats().tier_miss_blocks > 0
    eng.close()


def test_a_quantized_kv_pool_spills_and_reads_back_under_its_own_key(tmp_path):
    """--kv-cache-dtype int8: blocks spill dequantized (a wire codec codes them as any KV), come back into the
    quantized pool as the same bytes, and are never read by a float pool (its KV differs)."""
    def int8_engine():
        cache = CacheConfig(num_blocks=BLOCKS, tier_dir=str(tmp_path), tier_bytes=CAPACITY, kv_dtype="int8")
        return LLMEngine.from_dir(MODEL_DIR, "fp32", "cpu", cache, EngineConfig())
    ref = LLMEngine.from_dir(MODEL_DIR, "fp32", "cpu", CacheConfig(num_blocks=256, kv_dtype="int8"), EngineConfig())
    want = run(ref, prompt(0), rid="ref")[0]
    eng = int8_engine()
    for i in range(4):
        run(eng, prompt(i), rid=f"f{i}")
    eng.close()
    eng = int8_engine()
    tokens, cached = run(eng, prompt(0))
    assert cached == 80 and eng.stats().tier_hit_blocks == 5 and tokens == want
    eng.close()
    assert run(engine(tmp_path), prompt(0), rid="float")[1] == 0
