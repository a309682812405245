"""Block manager: allocation, ref counts, prefix cache hits, LRU eviction (no tensors)."""

import pytest

from edgecore.shared.kv.block_manager import BlockManager, BlockTable, NoFreeBlocks, prefix_hashes


def alloc(bm, tokens, n=None):
    table = BlockTable()
    cached = bm.allocate_prompt(table, tokens, len(tokens) if n is None else n)
    return table, cached


def test_allocates_enough_blocks_and_frees_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    table, cached = alloc(bm, list(range(10)))
    assert cached == 0 and len(table.blocks) == 3 and bm.num_free == 5
    bm.free_table(table)
    assert bm.num_free == 8 and table.blocks == []


def test_prefix_hit_shares_full_blocks_only_and_never_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(12))
    t1, _ = alloc(bm, tokens)
    bm.register_full_blocks(t1, tokens, 12)
    # Same 12 tokens: blocks 0,1 are shared; the block holding the last token is fresh.
    t2, cached = alloc(bm, tokens)
    assert cached == 8
    assert t2.blocks[:2] == t1.blocks[:2] and t2.blocks[2] != t1.blocks[2]
    assert bm.blocks[t1.blocks[0]].ref_count == 2
    # Diverging in the second block: only the first is shared.
    t3, cached = alloc(bm, tokens[:4] + [99] * 8)
    assert cached == 4 and t3.blocks[0] == t1.blocks[0] and t3.blocks[1] != t1.blocks[1]


def test_released_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = [1, 2, 3, 4, 5]
    ta, _ = alloc(bm, a)
    bm.register_full_blocks(ta, a, 5)
    bm.free_table(ta)
    assert len(bm.evictable) == 2 and bm.num_free == 4
    tb, cached = alloc(bm, a)            # comes back from the evictable LRU
    assert cached == 4 and not bm.evictable
    bm.free_table(tb)
    # A different prompt needing every block evicts the cached ones.
    tc, cached = alloc(bm, [9, 9, 9, 9, 9, 9, 9, 9])
    assert cached == 0 and len(tc.blocks) == 4 and not bm.cached
    bm.free_table(tc)
    td, cached = alloc(bm, a)
    assert cached == 0


def test_lru_evicts_least_recently_released_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    x, y = [1, 1, 7], [2, 2, 7]
    tx, _ = alloc(bm, x)
    bm.register_full_blocks(tx, x, 3)
    ty, _ = alloc(bm, y)
    bm.register_full_blocks(ty, y, 3)
    bm.free_table(tx)   # x's full block released first → evicted first
    bm.free_table(ty)
    assert len(bm.free) == 2 and len(bm.evictable) == 2
    held = [alloc(bm, [5, 5])[0], alloc(bm, [6, 6])[0]]   # both from the free list
    held.append(alloc(bm, [4, 4])[0])                      # must evict: x's block goes, y's stays
    assert bm.match_prefix(y + [0]) != []
    for t in held:
        bm.free_table(t)
    assert alloc(bm, y)[1] == 2
    assert bm.match_prefix(x) == []
    with pytest.raises(NoFreeBlocks):
        alloc(bm, [8] * 6)


def test_all_or_nothing_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(NoFreeBlocks):
        alloc(bm, list(range(9)))
    assert bm.num_free == 2
    table, _ = alloc(bm, list(range(4)))
    with pytest.raises(NoFreeBlocks):
        bm.grow(table, 12)
    assert len(table.blocks) == 1 and bm.num_free == 1


def test_chained_hashes_depend_on_whole_prefix():
    h1 = prefix_hashes([1, 2, 3, 4], 2)
    h2 = prefix_hashes([9, 9, 3, 4], 2)
    assert len(h1) == 2 and h1[1] != h2[1]
    assert prefix_hashes([1, 2, 3], 2) == h1[:1]


def test_release_before_frees_leading_blocks_once():
    from edgecore.shared.kv.block_manager import BlockManager, BlockTable
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    table = BlockTable()
    bm.allocate_prompt(table, list(range(20)), 20)
    assert bm.num_free == 11
    assert bm.release_before(table, 9) == 2            # positions 0-7 are in blocks 0 and 1
    assert table.blocks[:2] == [-1, -1] and bm.num_free == 13
    assert bm.release_before(table, 9) == 0            # nothing twice
    assert bm.release_before(table, 100) == 3          # never past the table
    bm.free_table(table)
    assert bm.num_free == 16 and table.num_released == 0


def test_release_before_keeps_unregistered_blocks_with_caching():
    from edgecore.shared.kv.block_manager import BlockManager, BlockTable
    bm = BlockManager(16, 4)
    table = BlockTable()
    tokens = list(range(20))
    bm.allocate_prompt(table, tokens, 20)
    first_two = table.blocks[:2]
    bm.register_full_blocks(table, tokens, 8)          # only blocks 0, 1 computed and hashed
    assert bm.release_before(table, 16) == 2           # block 2 is not registered yet: kept
    assert table.blocks[2] >= 0 and len(bm.evictable) == 2
    assert bm.match_prefix(tokens + [99]) == first_two  # released but cached: a later prefix reuses them


def test_freed_blocks_are_reused_before_untouched_ones():
    """The pool maps its memory lazily: churn must not wander over the whole capacity."""
    bm = BlockManager(num_blocks=1000, block_size=4, enable_prefix_caching=False)
    seen = set()
    for i in range(50):                     # requests of 1-3 blocks come and go, two alive at a time
        a, b = BlockTable(), BlockTable()
        bm.allocate_prompt(a, list(range(i % 9 + 1)), 2)
        bm.allocate_prompt(b, list(range(5)), 4)
        seen.update(a.blocks + b.blocks)
        bm.free_table(a)
        bm.free_table(b)
    assert max(seen) < 6                    # the high-water mark of blocks alive at once, not 1000
