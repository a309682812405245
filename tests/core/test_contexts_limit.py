"""Pinned contexts at the core hold at most `PINNED_SHARE` of the KV pool: beyond it an ingest is a 400 that
names the limit (nothing pinned, nothing stored), and deleting a context makes room again."""

import itertools
from types import SimpleNamespace

import pytest

from edgecore.core.contexts import PINNED_SHARE, Contexts
from edgecore.shared.openai.request import ApiError


class FakeHandle:
    block_size = 16

    def __init__(self, blocks_total: int):
        self.blocks_total = blocks_total
        self.next_block = itertools.count()
        self.prompts: dict[str, int] = {}
        self.unpinned: list[list[int]] = []

    def stats(self):
        return SimpleNamespace(blocks_total=self.blocks_total)

    async def generate(self, rid, token_ids, params, prefill_only=False):
        self.prompts[rid] = len(token_ids)
        yield None

    async def pin_prefix(self, rid):
        return [next(self.next_block) for _ in range(self.prompts[rid] // self.block_size)]

    async def unpin(self, blocks):
        self.unpinned.append(blocks)


class FakeStore:
    def __init__(self):
        self.saved: dict[str, list[int]] = {}

    def save_context(self, ctx, token_ids):
        self.saved[ctx] = token_ids

    def delete_context(self, ctx):
        self.saved.pop(ctx)


async def test_contexts_beyond_their_share_are_refused_until_one_is_deleted():
    handle, store = FakeHandle(64), FakeStore()
    contexts = Contexts(handle, store)
    allowed = int(64 * PINNED_SHARE)                    # 32 blocks; each 200-token context pins 12
    a = await contexts.ingest(list(range(200)))
    b = await contexts.ingest(list(range(1, 201)))
    assert await contexts.ingest(list(range(200))) == a          # the same tokens: the same context, no pin
    with pytest.raises(ApiError) as exc:
        await contexts.ingest(list(range(2, 202)))
    assert exc.value.status == 400 and exc.value.code == "context_limit_exceeded" and str(allowed) in str(exc.value)
    assert len(contexts.pinned) == 2 and len(store.saved) == 2    # nothing pinned or stored for the refused one
    assert await contexts.delete(a["id"])
    assert (await contexts.ingest(list(range(2, 202))))["id"] not in (a["id"], b["id"])
