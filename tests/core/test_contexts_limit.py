"""Pinned contexts at the core hold at most `PINNED_SHARE` of the KV pool: beyond it an ingest is a 400 that
names the limit (nothing pinned, nothing stored), and deleting a context makes room again."""

import pytest

from edgecore.core.contexts import PINNED_SHARE, Contexts
from edgecore.shared.openai.request import ApiError
from tests.shared.fake_handle import FakeHandle


class FakeStore:
    def __init__(self):
        self.saved: dict[str, list[int]] = {}

    def save_context(self, ctx, token_ids):
        self.saved[ctx] = token_ids

    def delete_context(self, ctx):
        self.saved.pop(ctx)


async def test_contexts_beyond_their_share_are_refused_until_one_is_deleted():
    handle, store = FakeHandle(blocks_total=64), FakeStore()
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
    assert all(r.prefill_only for r in handle.requests.values())     # each context is prefilled only
