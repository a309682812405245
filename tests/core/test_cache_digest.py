"""Prefix digests: the block manager's journal, the core's CacheDigests (reset, changes, frames, an edge that stops
reading), the edge's CoreCache and the capability that gates the message. No sockets, no model."""

from types import SimpleNamespace

import numpy as np
import pytest

from edgecore.shared.node.cache_digest import CacheDigests, frames
from edgecore.core.outbox import Outbox
from edgecore.edge.core_cache import CoreCache, PromptHashes
from edgecore.protocol import messages as m
from edgecore.protocol.errors import LocalProtocolError, RemoteProtocolError
from edgecore.protocol.state import Connection, Role
from edgecore.shared.kv.block_manager import BlockManager, BlockTable, prefix_hashes
from tests.protocol.pairs import CODECS, FP, SECRET, deliver, handshake


def hashes(raw: bytes) -> set[int]:
    return set(np.frombuffer(raw, "<u8").tolist())


def test_journal_notes_every_hash_cached_and_forgotten():
    bm = BlockManager(num_blocks=4, block_size=2)
    ids = [1, 2, 3, 4, 5]
    table = BlockTable()
    bm.allocate_prompt(table, ids, len(ids))
    bm.register_full_blocks(table, ids, len(ids))
    first = bm.take_journal()                       # turns it on: everything cached now
    assert first == dict.fromkeys(prefix_hashes(ids, 2), True) and len(first) == 2
    assert bm.take_journal() == {}
    bm.free_table(table)                            # released: still cached, evictable; nothing changes
    assert bm.take_journal() == {}
    other, taken = BlockTable(), [9, 9, 8, 8, 7, 7, 6, 6]
    bm.allocate_prompt(other, taken, len(taken))    # 4 blocks: both cached ones are evicted
    assert bm.take_journal() == dict.fromkeys(first, False)
    bm.register_full_blocks(other, taken, len(taken))
    assert bm.take_journal() == dict.fromkeys(prefix_hashes(taken, 2), True)
    bm.free_table(other)
    bm.reset_prefix_cache()
    assert bm.take_journal() == dict.fromkeys(prefix_hashes(taken, 2), False)


class FakePeer:
    def __init__(self, capable: bool = True):
        self.conn = SimpleNamespace(peer_capabilities=[m.PREFIX_DIGEST] if capable else [])


class Journal:
    def __init__(self):
        self.next: dict[int, bool] = {}

    async def __call__(self) -> dict[int, bool]:
        out, self.next = self.next, {}
        return out


def drain(outbox: Outbox) -> list[m.CacheDigest]:
    out = []
    while not outbox.empty():
        out.append(outbox.get_nowait())
    return out


def replay(cache: CoreCache, digests: list[m.CacheDigest]) -> None:
    for d in digests:
        cache.apply(d)


@pytest.mark.asyncio
async def test_each_edge_gets_the_whole_set_then_the_changes_and_a_stalled_edge_holds_one_digest():
    journal, queued = Journal(), [0]
    fast, slow, old = (FakePeer(), Outbox()), (FakePeer(), Outbox()), (FakePeer(capable=False), Outbox())
    sessions = [fast, slow]
    digests = CacheDigests(journal, 16, lambda: queued[0], lambda: [*sessions, old])
    journal.next = {1: True, 2: True}
    await digests.tick()
    mirror_fast, mirror_slow = CoreCache(), CoreCache()
    replay(mirror_fast, drain(fast[1]))
    assert mirror_fast.hashes == {1, 2} and mirror_fast.block_size == 16 and old[1].empty()
    # The slow edge reads nothing: later changes pile up as pending, never as queued frames.
    for step in range(50):
        journal.next = {100 + step: True, 1: step % 2 == 1}
        queued[0] = step
        await digests.tick()
        replay(mirror_fast, drain(fast[1]))
        assert len(slow[1]) == 1
    assert mirror_fast.hashes == {2, *range(100, 150), 1} and mirror_fast.queued_tokens == 49
    replay(mirror_slow, drain(slow[1]))             # it reads again: the reset it holds, then everything since
    await digests.tick()
    replay(mirror_slow, drain(slow[1]))
    assert mirror_slow.hashes == mirror_fast.hashes == digests.mirror and mirror_slow.queued_tokens == 49
    # A new edge (a reconnect) starts from the whole set.
    late = (FakePeer(), Outbox())
    sessions.append(late)
    await digests.tick()
    mirror_late = CoreCache()
    replay(mirror_late, drain(late[1]))
    assert mirror_late.hashes == digests.mirror


@pytest.mark.asyncio
async def test_a_pending_set_larger_than_the_cache_becomes_one_reset():
    journal = Journal()
    slow = (FakePeer(), Outbox())
    digests = CacheDigests(journal, 16, lambda: 0, lambda: [slow])
    await digests.tick()
    for step in range(3):            # churn: many hashes come and go while the edge reads nothing
        journal.next = {h: True for h in range(step * 5000, step * 5000 + 5000)}
        journal.next.update({h: False for h in range((step - 1) * 5000, step * 5000)} if step else {})
        await digests.tick()
    edge = digests.edges[slow[0]]
    assert not edge.announced and not edge.pending     # the changes outgrew the cache: the whole set goes again
    mirror = CoreCache()
    replay(mirror, drain(slow[1]))
    await digests.tick()
    sent = drain(slow[1])
    assert sent[0].reset and len(sent) == 2                  # 5000 hashes: two frames
    replay(mirror, sent)
    assert mirror.hashes == digests.mirror == set(range(10000, 15000))


def test_frames_split_at_the_limit_and_only_the_first_resets():
    out = frames(8, list(range(m.DIGEST_MAX_HASHES + 10)), [1, 2, 3], True, 5)
    assert [f.reset for f in out] == [True, False]
    assert sum(len(f.stored) + len(f.evicted) for f in out) == 8 * (m.DIGEST_MAX_HASHES + 13)
    assert all(len(f.stored) + len(f.evicted) <= 8 * m.DIGEST_MAX_HASHES for f in out)
    assert frames(8, [], [], False, 3) == [m.CacheDigest(8, b"", b"", False, 3)]


def test_core_cache_counts_whole_blocks_under_the_salt_and_ignores_malformed_frames():
    ids = list(range(100, 150))                       # 50 tokens: 3 blocks of 16 among the first 49
    cache = CoreCache()
    assert cache.cached_tokens(PromptHashes(ids, None)) == 0 and not cache.known
    salted = prefix_hashes(ids, 16, 49, "tenant-a")
    plain = prefix_hashes(ids, 16, 49)
    cache.apply(frames(16, plain[:2] + salted, [], True, 7)[0])
    assert cache.cached_tokens(PromptHashes(ids, None)) == 32
    assert cache.cached_tokens(PromptHashes(ids, "tenant-a")) == 48
    assert cache.cached_tokens(PromptHashes(ids, "tenant-b")) == 0 and cache.queue == 7
    cache.prefill_sent(100)
    assert cache.queue == 107
    cache.apply(m.CacheDigest(16, b"\x00" * 7))        # not whole hashes
    cache.apply(m.CacheDigest(0, b""))                 # no block size
    cache.apply(m.CacheDigest(1 << 20, b""))           # a block size no engine has
    assert cache.malformed == 3 and cache.cached_tokens(PromptHashes(ids, "tenant-a")) == 48
    cache.apply(frames(16, [], [salted[1]], False, 0)[0])      # the second block evicted: the chain stops there
    assert cache.cached_tokens(PromptHashes(ids, "tenant-a")) == 16 and cache.queue == 0


def connected(edge_capabilities):
    client = Connection(Role.CLIENT, SECRET, FP, CODECS, name="edge", capabilities=edge_capabilities)
    server = Connection(Role.SERVER, SECRET, FP, CODECS, name="core")
    handshake(client, server)
    return client, server


def test_a_core_sends_digests_only_to_an_edge_that_asked():
    client, server = connected([*m.CAPABILITIES, m.PREFIX_DIGEST])
    msg = frames(16, [5, 2**64 - 1], [], True, 3)[0]
    [got] = deliver(server.send_bytes(msg), client)
    assert got == msg and hashes(got.stored) == {5, 2**64 - 1}
    with pytest.raises(LocalProtocolError):           # only a core tells what it holds
        client.send_bytes(msg)
    client, server = connected(None)                   # an edge that did not ask (an older release)
    with pytest.raises(LocalProtocolError, match="prefix-digest"):
        server.send_bytes(msg)


def test_an_unannounced_digest_is_a_protocol_error():
    client, server = connected(None)
    server.peer_capabilities.append(m.PREFIX_DIGEST)   # a core that wrongly believes the edge asked
    with pytest.raises(RemoteProtocolError, match="prefix-digest"):
        deliver(server.send_bytes(m.CacheDigest(16)), client)


def test_prompt_hashes_are_the_block_managers_and_computed_only_as_far_as_asked():
    ids = list(range(7, 107))
    for size, salt in ((16, None), (8, "s"), (1, None)):
        lazy = PromptHashes(ids, salt)
        assert [lazy.get(size, i) for i in range(len(ids))][:(len(ids) - 1) // size] == \
            prefix_hashes(ids, size, len(ids) - 1, salt)
        assert lazy.get(size, (len(ids) - 1) // size) is None
    lazy = PromptHashes(ids, None)
    lazy.get(16, 1)
    assert len(lazy._by_size[16][0]) == 2


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.asyncio
async def test_an_edge_mirror_agrees_with_the_core_cache_under_random_traffic(block_size):
    """Random prompts, salts (none, tenants, LoRA scopes) and evictions on a small pool: after every digest the
    edge's mirror is the block manager's cache, and its `cached_tokens` is the core's own prefix match."""
    import random

    from edgecore.shared.models.lora import scope_salt
    rng = random.Random(block_size)
    bm = BlockManager(num_blocks=24, block_size=block_size)
    edge = (FakePeer(), Outbox())

    async def journal() -> dict[int, bool]:
        return bm.take_journal()
    digests = CacheDigests(journal, block_size, lambda: 0, lambda: [edge])
    mirror = CoreCache()
    salts = [None, "tenant-a", scope_salt(None, "sql", "0123456789abcdef"), scope_salt("tenant-a", "sql", "f" * 16)]
    stems = [[rng.randrange(1, 50) for _ in range(40)] for _ in range(3)]
    for _ in range(60):
        ids = rng.choice(stems)[:rng.randrange(2, 40)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 8))]
        table = BlockTable(salt=rng.choice(salts))
        try:
            bm.allocate_prompt(table, ids, len(ids))
        except Exception:
            continue
        bm.register_full_blocks(table, ids, len(ids))
        bm.free_table(table)
        if rng.random() < 0.05:
            bm.reset_prefix_cache()
        await digests.tick()
        replay(mirror, drain(edge[1]))
        assert mirror.hashes == set(bm.cached)
        for salt in salts:
            probe = rng.choice(stems)[:rng.randrange(2, 40)]
            assert mirror.cached_tokens(PromptHashes(probe, salt)) == \
                len(bm.match_prefix(probe, salt)) * block_size
