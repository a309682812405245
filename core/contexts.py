"""Shared contexts at the core: prefill a prefix once and keep its KV resident.

Life cycle: `ingest(token_ids)` prefills the tokens (interactive priority),
pins the request's full blocks in the prefix cache and releases the request;
later prompts that start with the same tokens reuse those blocks through the
ordinary prefix cache instead of recomputing. The id is a hash of the tokens,
so ingesting the same context twice is one context. Contexts are recorded in
the batch store and ingested again when the core restarts. `delete` unpins.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from array import array

from edgecore.shared.engine.sampling_params import SamplingParams


def context_id(token_ids: list[int]) -> str:
    return "ctx_" + hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=12).hexdigest()


class Contexts:
    def __init__(self, handle, store):
        self.handle = handle              # the engine handle (shared/engine/handle.py)
        self.store = store
        self.pinned: dict[str, dict] = {}

    async def restore(self) -> None:
        for row in self.store.contexts():
            await self.ingest(json.loads(row["token_ids"]), persist=False)

    async def ingest(self, token_ids: list[int], persist: bool = True) -> dict:
        ctx = context_id(token_ids)
        if ctx in self.pinned:
            return self.describe(ctx)
        rid = f"context/{uuid.uuid4().hex}"
        async for _ in self.handle.generate(rid, token_ids, SamplingParams(max_tokens=1, temperature=0),
                                        prefill_only=True):
            pass
        blocks = await self.handle.pin_prefix(rid)
        self.pinned[ctx] = {"blocks": blocks, "tokens": len(token_ids), "token_ids": list(token_ids),
                            "created_at": int(time.time())}
        if persist:
            self.store.save_context(ctx, token_ids)
        return self.describe(ctx)

    def tokens(self, ctx: str) -> list[int] | None:
        info = self.pinned.get(ctx)
        return info["token_ids"] if info else None

    def describe(self, ctx: str) -> dict | None:
        info = self.pinned.get(ctx)
        if info is None:
            return None
        bs = self.handle.block_size
        return {"id": ctx, "object": "context", "tokens": info["tokens"], "cached_tokens": len(info["blocks"]) * bs,
                "created_at": info["created_at"]}

    async def delete(self, ctx: str) -> bool:
        info = self.pinned.pop(ctx, None)
        if info is None:
            return False
        await self.handle.unpin(info["blocks"])
        self.store.delete_context(ctx)
        return True
