"""The KV resident bound (`--kv-resident-memory`): past it, cached blocks are evicted before new ones are touched."""

import argparse
import random

import pytest

from edgecore.shared.models.config import CacheConfig, ModelConfig
from edgecore.shared.node.env import BUNDLED_MODEL
from edgecore.shared.errors import ConfigError
from edgecore.shared.kv.block_manager import BlockManager, BlockTable, NoFreeBlocks


def serve(bm: BlockManager, tokens: list[int], new: int = 3) -> tuple[BlockTable, int]:
    """One request's life: its prompt (cached prefix looked up), computed and registered, decoded, freed."""
    table = BlockTable()
    cached = bm.allocate_prompt(table, tokens, len(tokens))
    bm.register_full_blocks(table, tokens, len(tokens))
    bm.grow(table, len(tokens) + new)
    bm.free_table(table)
    return table, cached


def unique(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1 << 30) for _ in range(n)]


def test_unique_traffic_stays_within_the_bound_and_reuses_cached_blocks():
    bm = BlockManager(num_blocks=4096, block_size=4, resident_blocks=40)
    rng = random.Random(0)
    for i in range(500):
        serve(bm, unique(rng, rng.randint(5, 30)))
        assert bm.touched <= 40, i
    assert bm.touched == 40                   # it filled the bound, then reused: never the 4096 of the budget
    assert len(bm.evictable) > 30             # what is not in use stays cached up to the bound
    assert bm.num_free == 4096


def test_without_a_bound_unique_traffic_touches_new_blocks_before_evicting():
    """Today's behaviour (and the default): every released full block stays cached until the budget is touched."""
    bm = BlockManager(num_blocks=4096, block_size=4)
    assert bm.resident_blocks == 4096
    rng = random.Random(0)
    for _ in range(500):
        serve(bm, unique(rng, rng.randint(5, 30)))
    assert bm.touched > 1500                  # about every full block of the 500 prompts


def test_a_repeated_prefix_still_hits_under_the_bound():
    bm = BlockManager(num_blocks=4096, block_size=4, resident_blocks=32)
    rng = random.Random(1)
    system = unique(rng, 16)                  # 4 full blocks shared by every request
    serve(bm, system + unique(rng, 5))
    for i in range(300):
        _, cached = serve(bm, system + unique(rng, rng.randint(5, 20)))
        assert cached == 16, i                # the hot prefix is used last, so the LRU never evicts it
        assert bm.touched <= 32
    hot = bm.match_prefix(system + [0])
    assert len(hot) == 4 and all(b < 32 for b in hot)


def test_a_prefix_used_within_the_bound_hits_and_one_older_is_evicted():
    bm = BlockManager(num_blocks=1024, block_size=4, resident_blocks=16)
    rng = random.Random(2)
    first = unique(rng, 9)                    # 2 full blocks cached
    serve(bm, first)
    for _ in range(2):                        # 2 x 3 blocks of other traffic: the bound is not reached yet
        serve(bm, unique(rng, 9))
    assert serve(bm, first)[1] == 8
    for _ in range(10):                       # 30 blocks more: `first` is now the least recently used
        serve(bm, unique(rng, 9))
    assert serve(bm, first)[1] == 0 and bm.touched <= 16


def test_live_sequences_may_go_beyond_the_bound_up_to_the_budget():
    """The bound orders eviction before touching; it never makes a request wait (the budget does)."""
    bm = BlockManager(num_blocks=64, block_size=4, resident_blocks=8)
    rng = random.Random(3)
    live = [BlockTable() for _ in range(4)]
    for t in live:
        bm.allocate_prompt(t, unique(rng, 16), 16)   # 4 blocks each: 16 blocks held at once
    assert bm.touched == 16
    for t in live:
        bm.free_table(t)
    for _ in range(100):                      # afterwards those pages are reused; nothing new is touched
        serve(bm, unique(rng, 10))
    assert bm.touched == 16
    with pytest.raises(NoFreeBlocks):         # the budget stays the hard ceiling
        bm.allocate_prompt(BlockTable(), unique(rng, 4 * 65), 4 * 65)


def test_free_touched_blocks_come_before_untouched_ones_after_a_cache_reset():
    bm = BlockManager(num_blocks=100, block_size=4, resident_blocks=10)
    rng = random.Random(4)
    for _ in range(10):
        serve(bm, unique(rng, 8))
    bm.reset_prefix_cache()
    assert not bm.evictable and bm.touched == 10
    for _ in range(20):
        serve(bm, unique(rng, 8))
    assert bm.touched == 10


def test_a_bound_of_at_least_one_block():
    with pytest.raises(ValueError, match="at least 1"):
        BlockManager(16, 4, resident_blocks=0)
    assert BlockManager(16, 4, resident_blocks=100).resident_blocks == 16


def args(**kw) -> argparse.Namespace:
    base = {"kv_cache_memory": "64MiB", "kv_blocks": None, "kv_resident_memory": None}
    return argparse.Namespace(**{**base, **kw})


def test_the_setting_becomes_resident_blocks():
    from edgecore.shared.node.cli import kv_cache_config
    config = ModelConfig.from_dir(BUNDLED_MODEL)       # 2048 bytes per token in fp32: 32 KiB per block
    cache, line = kv_cache_config(args(), config, 4)
    assert cache == CacheConfig(num_blocks=2048) and cache.resident_blocks is None and "resident" not in line
    cache, line = kv_cache_config(args(kv_resident_memory="8MiB"), config, 4)
    assert (cache.num_blocks, cache.resident_blocks) == (2048, 256)
    assert "resident bound 256 blocks = 8.0 MiB" in line
    cache, _ = kv_cache_config(args(kv_resident_memory="1GiB"), config, 4)     # above the budget: the budget
    assert cache.resident_blocks == 2048
    cache, _ = kv_cache_config(args(kv_blocks=100, kv_resident_memory="1MiB"), config, 4)
    assert (cache.num_blocks, cache.resident_blocks) == (100, 32)
    cache, _ = kv_cache_config(args(kv_resident_memory="8MiB"), config, 4, tp=2)   # a rank holds half a token
    assert cache.resident_blocks == 512
    with pytest.raises(ConfigError, match="--kv-resident-memory"):
        kv_cache_config(args(kv_resident_memory="lots"), config, 4)
    with pytest.raises(ConfigError, match="--kv-resident-memory.*holds no block"):
        kv_cache_config(args(kv_resident_memory="1KiB"), config, 4)


def test_both_nodes_take_the_setting():
    from edgecore.core.settings import CoreSettings
    from edgecore.edge.settings import EdgeSettings
    assert EdgeSettings().kv_resident_memory is None and CoreSettings().kv_resident_memory is None
