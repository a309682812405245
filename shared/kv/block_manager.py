"""Paged KV block bookkeeping: no tensors, only block ids, ref counts and hashes.

Life cycle of a block: free → allocated to one or more sequences (ref_count ≥ 1)
→ once full and computed, registered in the prefix cache under the chained
hash of its tokens → released (ref_count 0): a hashed block waits in an LRU of
evictable cached blocks (a later request with the same prefix takes it back),
an unhashed one returns to the front of the free list.

Allocation and resident memory: on CPU the pool (shared/kv/pool.py) maps its memory lazily, so a block
costs resident memory from the first time it is handed out ("touched") until the process ends; `touched`
counts those blocks (untouched ones are handed out in id order). A request's new block comes from, in order:
1. a touched free block (the most recently freed first): no new page, no cached prefix lost;
2. an untouched block, while fewer than `resident_blocks` blocks were ever touched;
3. the least recently released cached block (evicted: its prefix is forgotten);
4. an untouched block beyond `resident_blocks` (only when every touched block is in use by live sequences:
   the bound never makes a request wait; `num_blocks`, the budget, is the hard ceiling).
`resident_blocks` (`--kv-resident-memory`; None: `num_blocks`) is the trade-off between prefix-cache hit
rate and resident memory. Without a bound (today's behaviour) every released full block stays cached until
the whole budget has been touched: the best hit rate the budget allows, but under sustained unique traffic
resident KV climbs to the whole budget, since a never-touched block is preferred to evicting a cached one.
With a bound, cached blocks are evicted (LRU) and their pages reused before a new page is touched, so
resident KV levels off at max(bound, the most blocks live sequences ever held at once), while prefixes
still hit as long as they were used among the last `resident_blocks` blocks' worth of traffic. The bound
is bookkeeping only: pages touched beyond it (a burst of live sequences) stay resident and are reused.

Chained hash: hash(block i) = H(hash(block i-1) ‖ tokens of block i), so a hit
on block i means the whole prefix up to it matches. Only full blocks are ever
shared, and the last prompt token is always recomputed (its logits are needed),
so shared blocks are never written.

Cache salt (a tenant's scope, vLLM's `cache_salt`): a sequence's table carries its salt
(`BlockTable.salt`), which is mixed into the hash of its first block only; since every later hash
chains on it, every block hash of a salted prompt differs from the same tokens' under any other salt
(or none), so blocks are reused only between requests with the same salt. None: the unsalted chain,
shared by every request without a salt (pinned contexts are unsalted).

Released prefixes: in a model whose every layer attends only to a window or a chunk, the leading
blocks no layer can attend to any more are released while the sequence runs (`release_before`);
their table entries become -1 (the runner reads them as block 0, masked out).

Disk tier (shared/kv/tier.py): `on_evict` is told of each cached block evicted (before its pages are reused) so
its KV can be spilled; `adopt` registers a block whose KV is read back from there as cached.

Journal (a core's prefix digest for its edges, shared/node/cache_digest.py): once `take_journal` has been called, every
hash entered into or dropped from the cache is noted with its latest state, and the next call hands the notes over.

Partly filled blocks: a sequence whose KV came from a core may lack the KV of windowed layers before
their window (`BlockTable.uncached_before`); its blocks there keep their place in the hash chain but are
never entered into the cache, so no later prompt can take them as a computed prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field


def block_hash(prev: int | None, tokens: Iterable[int], salt: str | None = None) -> int:
    """H(prev ‖ tokens), and for a salted chain's first block (`salt`, given with `prev` None) ‖ the salt."""
    h = hashlib.blake2b(digest_size=8)
    h.update((prev or 0).to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    if salt is not None:        # after a fixed-size token block, so no unsalted input can equal a salted one
        raw = salt.encode("utf-8", "surrogatepass")
        h.update(b"salt" + len(raw).to_bytes(8, "little") + raw)
    return int.from_bytes(h.digest(), "little")


def chained_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None,
                   salt: str | None = None) -> Iterator[int]:
    """The chained hashes of the full blocks among the first `limit` tokens, one at a time (`salt`: mixed into
    the first): a caller that stops at the first miss hashes no further."""
    n = len(token_ids) if limit is None else min(limit, len(token_ids))
    prev = None
    for start in range(0, n - block_size + 1, block_size):
        prev = block_hash(prev, token_ids[start:start + block_size], salt if prev is None else None)
        yield prev


def prefix_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None,
                  salt: str | None = None) -> list[int]:
    """Chained hashes of the full blocks among the first `limit` tokens (`salt`: mixed into the first)."""
    return list(chained_hashes(token_ids, block_size, limit, salt))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    salt: str | None = None     # the cache salt of the chain its hash belongs to (the disk tier's key needs it)


@dataclass
class BlockTable:
    """What a sequence owns: its block ids and how many of them are registered in the cache."""
    blocks: list[int] = field(default_factory=list)
    num_hashed: int = 0
    last_hash: int | None = None
    num_released: int = 0      # leading entries released (-1) because no layer attends to them
    uncached_before: int = 0   # blocks holding positions before this are never cached (KV partly missing)
    salt: str | None = None    # the cache salt mixed into the first block's hash (kept across `free_table`)


class NoFreeBlocks(Exception):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 resident_blocks: int | None = None) -> None:
        if resident_blocks is not None and resident_blocks < 1:
            raise ValueError(f"resident_blocks must be at least 1, not {resident_blocks}")
        self.block_size = block_size
        # Blocks ever touched before cached ones are evicted rather than a new page touched (module docstring).
        self.resident_blocks = num_blocks if resident_blocks is None else min(resident_blocks, num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()   # hashed blocks with ref 0, LRU first
        self.cached: dict[int, int] = {}                          # hash → block id
        self.caching = enable_prefix_caching
        self.touched = 0       # blocks ever handed out: the untouched ones are never resident (ids in order)
        self.hits = 0          # prompt tokens served from the cache (counter)
        self.queries = 0       # prompt tokens looked up (counter)
        # Called with (block id, hash, salt) as a cached block is evicted, before its KV is overwritten (the disk
        # tier copies it out: shared/engine/tier_loads.py).
        self.on_evict: Callable[[int, int, str | None], None] | None = None
        # Hashes entered into (True) or dropped from (False) the cache since the journal was last taken, the latest
        # state of each; None: not kept (`take_journal` turns it on; a core's digest for its edges reads it).
        self.journal: dict[int, bool] | None = None

    # ---- capacity -------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks obtainable now: free plus evictable cached blocks."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.num_free

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table.blocks))

    # ---- allocation -----------------------------------------------------
    def _take(self) -> int:
        # The free list holds touched blocks first, then the untouched ones in id order (ids >= touched).
        if self.free and (self.free[0] < self.touched or self.touched < self.resident_blocks
                          or not self.evictable):
            bid = self.free.popleft()
            self.touched = max(self.touched, bid + 1)
        elif self.evictable:        # at the resident bound: forget the least recently used prefix, reuse its pages
            bid, _ = self.evictable.popitem(last=False)
            old = self.blocks[bid]
            if old.hash is not None and self.cached.get(old.hash) == bid:
                del self.cached[old.hash]
                if self.journal is not None:
                    self.journal[old.hash] = False
                if self.on_evict is not None:
                    self.on_evict(bid, old.hash, old.salt)
            old.hash = None
        else:
            raise NoFreeBlocks
        self.blocks[bid].ref_count = 1
        return bid

    def match_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """Cached block ids covering the longest cached prefix under `salt` (never the last token)."""
        if not self.caching:
            return []
        hits = []
        for h in prefix_hashes(token_ids, self.block_size, len(token_ids) - 1, salt):
            bid = self.cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def allocate_prompt(self, table: BlockTable, token_ids: Sequence[int], max_new_tokens: int,
                        use_cache: bool = True) -> int:
        """Give a new sequence its cached prefix blocks plus fresh blocks for up to
        `max_new_tokens` more tokens (`use_cache=False`: no cached prefix; the prefix is looked up under
        `table.salt`). Returns how many tokens are already cached.
        All or nothing: raises NoFreeBlocks and changes nothing when short.
        """
        hits = self.match_prefix(token_ids, table.salt) if use_cache else []
        cached_tokens = len(hits) * self.block_size
        cover = cached_tokens + min(len(token_ids) - cached_tokens, max_new_tokens)
        fresh = -(-cover // self.block_size) - len(hits)
        reclaim = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if fresh > self.num_free - reclaim:
            raise NoFreeBlocks
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                self.evictable.pop(bid, None)
            block.ref_count += 1
            table.blocks.append(bid)
        table.num_hashed = len(hits)
        table.last_hash = self.blocks[hits[-1]].hash if hits else None
        for _ in range(fresh):
            table.blocks.append(self._take())
        self.queries += len(token_ids)
        self.hits += cached_tokens
        return cached_tokens

    def adopt(self, block_hash: int, salt: str | None) -> tuple[int, bool]:
        """A cached block whose KV comes from outside the pool (the disk tier): the block already cached under
        this hash, or a new one registered under it (True: the caller writes its KV). Either way with one
        reference, the caller's (release it with `release_blocks`). Raises NoFreeBlocks."""
        bid = self.cached.get(block_hash)
        if bid is not None:
            self.pin([bid])
            return bid, False
        bid = self._take()
        block = self.blocks[bid]
        block.hash, block.salt = block_hash, salt
        self.cached[block_hash] = bid
        if self.journal is not None:
            self.journal[block_hash] = True
        return bid, True

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Make `table` cover `num_tokens` tokens. All or nothing."""
        need = self.blocks_needed(table, num_tokens)
        if need > self.num_free:
            raise NoFreeBlocks
        for _ in range(need):
            table.blocks.append(self._take())

    def register_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Enter every newly completed block (KV computed) into the prefix cache (under `table.salt`)."""
        if not self.caching:
            return
        full = min(num_computed, len(token_ids)) // self.block_size
        bs = self.block_size
        while table.num_hashed < full:
            i = table.num_hashed
            h = block_hash(table.last_hash, token_ids[i * bs:(i + 1) * bs], table.salt if i == 0 else None)
            block = self.blocks[table.blocks[i]]
            if block.hash is None and i * bs >= table.uncached_before:
                block.hash, block.salt = h, table.salt
                if self.cached.setdefault(h, block.block_id) == block.block_id and self.journal is not None:
                    self.journal[h] = True
            table.last_hash = h
            table.num_hashed += 1

    def free_table(self, table: BlockTable) -> None:
        """Release a sequence's blocks, last block first so that prefix heads stay cached longest."""
        self.release_blocks([b for b in reversed(table.blocks) if b >= 0])
        table.blocks.clear()
        table.num_hashed = 0
        table.last_hash = None
        table.num_released = 0
        table.uncached_before = 0

    def release_before(self, table: BlockTable, position: int) -> int:
        """Release the leading blocks that hold only positions before `position` (no layer attends to them
        any more); with prefix caching only blocks already registered (they stay cached, evictable).
        Returns how many blocks were released."""
        end = min(position // self.block_size, len(table.blocks))
        if self.caching:
            end = min(end, table.num_hashed)
        released = [b for b in table.blocks[table.num_released:end] if b >= 0]
        for i in range(table.num_released, end):
            table.blocks[i] = -1
        table.num_released = max(table.num_released, end)
        self.release_blocks(released)
        return len(released)

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; unreferenced cached blocks become evictable."""
        for bid in block_ids:
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None and self.cached.get(block.hash) == bid:
                    self.evictable[bid] = None
                else:       # reused first: its pages are resident and warm (the pool maps memory lazily)
                    block.hash = None
                    self.free.appendleft(bid)

    def pin(self, block_ids: list[int]) -> None:
        """Take an extra reference (pinned contexts, transfers in flight)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                self.evictable.pop(bid, None)
            block.ref_count += 1

    def reset_prefix_cache(self) -> None:
        for bid in list(self.evictable):
            self.blocks[bid].hash = None
            self.free.appendleft(bid)       # touched: ahead of the untouched blocks
        self.evictable.clear()
        kept = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}
        if self.journal is not None:
            self.journal.update((h, False) for h in self.cached if h not in kept)
        self.cached = kept

    def take_journal(self) -> dict[int, bool]:
        """The cache's changes since the previous call (hash → cached now); the first call starts the journal and
        returns every hash cached now."""
        if self.journal is None:
            self.journal = {}
            return dict.fromkeys(self.cached, True)
        changes, self.journal = self.journal, {}
        return changes
