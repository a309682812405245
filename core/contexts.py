"""Shared contexts at the core: prefill a prefix once and keep its KV resident.

Life cycle: `ingest(token_ids)` prefills the tokens (interactive priority),
pins the request's full blocks in the prefix cache and releases the request;
later prompts that start with the same tokens reuse those blocks through the
ordinary prefix cache instead of recomputing. The id is a hash of the tokens,
so ingesting the same context twice is one context. Contexts are recorded in
the batch store and ingested again when the core restarts. `delete` unpins.
Pinned contexts hold at most `PINNED_SHARE` of the KV pool (the rest serves
requests): a context beyond it is refused (400 `context_limit_exceeded`) until
others are deleted; on restart one that no longer fits is skipped and logged.

`push(ctx, names)` sends a context's tokens to edges the core was configured
with (`--push-edge NAME=URL`: name → API base URL), never to a URL a caller
gives, and with the core's own push key (`--push-api-key-file`), never the
caller's credentials; the answer reports each edge's status and token counts,
not the edge's raw reply. Redirects are not followed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from array import array
from typing import TYPE_CHECKING

from edgecore.shared.engine.handle import EngineRequest
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.openai.request import ApiError

if TYPE_CHECKING:
    from edgecore.core.batch_store import BatchStore
    from edgecore.core.http import ControlPort
    from edgecore.shared.engine.handle import EngineHandle

PUSH_TIMEOUT_S = 120.0
PINNED_SHARE = 0.5                # of the KV pool that pinned contexts may hold
MAX_EDGE_REPLY = 64 * 1024        # bytes of an edge's reply read back

log = logging.getLogger("edgecore.core")


def context_id(token_ids: list[int]) -> str:
    return "ctx_" + hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=12).hexdigest()


class Contexts:
    def __init__(self, handle: EngineHandle, store: BatchStore, control: ControlPort | None = None) -> None:
        self.handle = handle              # the engine handle (shared/engine/handle.py)
        self.store = store
        self.control = control            # core/http.py ControlPort: the edges pushes may go to, the push key
        self.pinned: dict[str, dict] = {}
        self._lock = asyncio.Lock()

    async def restore(self) -> None:
        for row in self.store.contexts():
            try:
                await self.ingest(json.loads(row["token_ids"]), persist=False)
            except ApiError as exc:       # the pool is smaller than when it was ingested: forget it for good
                self.store.delete_context(row["id"])
                log.warning("stored context %s dropped: it no longer fits (%s)", row["id"], exc)

    async def ingest(self, token_ids: list[int], persist: bool = True) -> dict:
        async with self._lock:            # one at a time: the limit is checked against what is pinned
            return await self._ingest(token_ids, persist)

    async def _ingest(self, token_ids: list[int], persist: bool) -> dict:
        ctx = context_id(token_ids)
        if ctx in self.pinned:
            return self._describe(ctx)
        bs = self.handle.block_size
        held = len(set().union(*(info["blocks"] for info in self.pinned.values())))
        allowed = int(self.handle.stats().blocks_total * PINNED_SHARE)
        if held + len(token_ids) // bs > allowed:
            raise ApiError(400, f"pinned contexts would hold more than {allowed} of the core's KV blocks ({held} held, "
                                f"this one needs {len(token_ids) // bs}); delete contexts first", "token_ids",
                           "context_limit_exceeded")
        rid = f"context/{uuid.uuid4().hex}"
        async for _ in self.handle.generate(EngineRequest(rid, token_ids, SamplingParams(max_tokens=1, temperature=0),
                                                          prefill_only=True)):
            pass
        blocks = await self.handle.pin_prefix(rid)
        self.pinned[ctx] = {"blocks": blocks, "tokens": len(token_ids), "token_ids": list(token_ids),
                            "created_at": int(time.time())}
        if persist:
            self.store.save_context(ctx, token_ids)
        return self._describe(ctx)

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

    def _describe(self, ctx: str) -> dict:
        """`describe` of a pinned context."""
        obj = self.describe(ctx)
        assert obj is not None
        return obj

    async def push(self, ctx: str, names: object) -> dict:
        """Send context `ctx` to the configured edges named in `names` (all of them when None)."""
        tokens = self.tokens(ctx)
        if tokens is None:
            raise ApiError(404, f"No context with id '{ctx}'", "id", "not_found")
        control = self.control
        known = dict(control.push_edges) if control is not None else {}
        if names is None:
            names = sorted(known)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ApiError(400, "'edges' must be a list of edge names", "edges", "invalid_type")
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            listed = ", ".join(sorted(known)) or "none (start the core with --push-edge NAME=URL)"
            raise ApiError(400, f"'edges' must name edges this core knows; unknown: {', '.join(unknown) or '(none given)'}"
                                f"; known: {listed}", "edges", "invalid_value")
        key = control.push_api_key if control is not None else None
        headers = {"Authorization": "Bearer " + key.decode()} if key else {}
        results = [await _push_one(name, known[name], tokens, headers) for name in names]
        return {"id": ctx, "object": "context.push", "results": results}


async def _push_one(name: str, base_url: str, tokens: list[int], headers: dict[str, str]) -> dict:
    import aiohttp
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PUSH_TIMEOUT_S)) as session:
            async with session.post(base_url.rstrip("/") + "/v1/contexts", json={"token_ids": tokens},
                                    headers=headers, allow_redirects=False) as resp:
                raw = await resp.content.read(MAX_EDGE_REPLY)
                status = resp.status
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return {"edge": name, "status": None, "error": f"could not reach the edge: {type(exc).__name__}"}
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = None
    if status == 200 and isinstance(reply, dict):
        return {"edge": name, "status": status, **{k: reply[k] for k, kind in (("tokens", int), ("cached_tokens", int),
                                                                          ("source", str))
                                                    if isinstance(reply.get(k), kind)}}
    err = reply.get("error") if isinstance(reply, dict) else None
    message = err.get("message") if isinstance(err, dict) and isinstance(err.get("message"), str) else None
    return {"edge": name, "status": status, "error": (message or f"the edge answered HTTP {status}")[:200]}
