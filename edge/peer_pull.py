"""KV pulled from a peer edge: a prompt whose cached prefix another edge holds costs only its new tokens here.

Life cycle: `EdgeNode` makes one `PeerPull` over the edges of `--peer` (each a `CoreClient` that checks for an
edge credential, edge/core_client.py) and starts it with the node: a `CoreRouter` keeps them connected, and each
one's CacheDigests (edge/peer_server.py sends them, as cores do) say which prefix blocks its pool holds.
For each request, before placement (`pulled`):
1. Plan: the healthy peers that serve blocks ("block-pull") at this edge's block size; the one holding the
   longest prefix of the prompt (its chained block hashes under the request's cache salt, edge/core_cache.py);
   worth a look only when it holds at least one whole block more than this edge's pool and disk tier.
2. Predict, as the placement does (edge/placement.py rates): without the pull, the best of the cores' predicted
   time to first token (edge/core_choice.py) and prefilling the uncached suffix here; with it, the round trip
   and the missing blocks' bytes at the link's measured rate (1 Gbit/s until measured), then prefilling only the
   rest here. The pull goes ahead only when predicted faster ("slower" is counted otherwise).
3. Pull: one BlockPull (lossless: the blocks join this edge's prefix cache as if computed here); the peer sends
   one KVChunk per block still in its pool, then BlockPullDone. Blocks are decoded on the decoder threads,
   checked against this pool's block geometry and cached (`EngineThread.adopt_blocks`) ADOPT_BLOCKS at a time.
4. Outcome: every block asked arrived → the request prefills here, only its suffix (placement reason
   "peer_pull"); some did (the peer evicted the rest) or none (the peer died, answered an Error, sent a bad block,
   went silent for the transfer timeout: Cancel sent) → the ordinary placement decides, with whatever was cached.
   Nothing is lost either way: a failed pull costs its time, never an error to the user or a wrong token.
Not pulled: requests with a LoRA adapter (their prefix cache is scoped per adapter), and an MLA model's latent blocks.
The peer announces and serves its pool only, not its disk tier.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from edgecore.edge.core_cache import PromptHashes
from edgecore.edge.core_choice import CoreChoice
from edgecore.edge.core_client import CoreClient, CoreRouter
from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.placement import PRIOR_SECONDS_PER_TOKEN, PrefillModel
from edgecore.protocol import messages as m
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import PeerError
from edgecore.shared.engine.block_share import Block
from edgecore.shared.engine.engine_thread import EngineThread
from edgecore.shared.engine.handle import EngineRequest
from edgecore.shared.kv.tier import BadTierFile, decode_block

placement_log = logging.getLogger("edgecore.placement")

DEFAULT_BANDWIDTH = 125e6     # bytes/s to a peer before a pull from it was measured (1 Gbit/s)
ADOPT_BLOCKS = 64             # blocks decoded before they are cached here (bounds what a pull holds in memory)
_ids = itertools.count(1)


@dataclass(frozen=True)
class PullPlan:
    client: CoreClient
    local: int                 # prompt tokens cached here already (whole blocks)
    held: int                  # prompt tokens the peer holds
    hashes: list[int]          # the blocks to pull: the peer's beyond this edge's
    seconds: float             # predicted time to first token with the pull
    without: float             # ... and without it


class PeerPull:
    def __init__(self, clients: list[CoreClient], handle: EngineThread, model: PrefillModel, metrics: EdgeMetrics,
                 decoders: Executor, rope: tuple[float, ...] | None, timeout: float) -> None:
        self.router = CoreRouter(clients)
        self.handle, self.model, self.metrics = handle, model, metrics
        self.decoders, self.rope, self.timeout = decoders, rope, timeout

    async def start(self) -> None:
        if self.router.clients:
            await self.router.start()

    async def stop(self) -> None:
        await self.router.stop()

    async def pulled(self, request: EngineRequest, choice: Callable[[EngineRequest], CoreChoice]) -> bool:
        """Pull the prompt's prefix from a peer when predicted faster; True when all of it is now cached here (the
        request then prefills its suffix here)."""
        if not self.router.clients or request.adapter or self.handle.block_shape is None:
            return False
        plan = await self._plan(request, choice)
        if plan is None:
            return False
        return await self._pull(request, plan)

    async def _plan(self, request: EngineRequest, choice: Callable[[EngineRequest], CoreChoice]) -> PullPlan | None:
        bs, ids = self.handle.block_size, request.prompt
        assert isinstance(ids, list)            # an edge request's prompt is token ids
        peers = [c for c in self.router.clients
                 if c.healthy and c.supports(m.BLOCK_PULL) and c.cache.block_size == bs]
        if not peers:
            return None
        hashes = PromptHashes(ids, request.cache_salt)
        held, client = max(((c.cache.cached_tokens(hashes), c) for c in peers), key=lambda hc: hc[0])
        if held < bs:
            return None
        local = await self.handle.cached_prefix(ids, request.cache_salt)
        if held - local < bs:
            return None
        rate = self.model.local_per_token or PRIOR_SECONDS_PER_TOKEN
        queue = self.handle.stats().prefill_tokens_left
        best = choice(request).best()
        without = min(best.seconds if best is not None else math.inf, (queue + len(ids) - local) * rate)
        wire = (held - local) * self.handle.kv_bytes_per_token / (client.bandwidth or DEFAULT_BANDWIDTH)
        seconds = client.rtt + wire + (queue + len(ids) - held) * rate
        blocks = [h for i in range(local // bs, held // bs) if (h := hashes.get(bs, i)) is not None]
        plan = PullPlan(client, local, held, blocks, seconds, without)
        if seconds >= without:
            self.metrics.peer_pulls.labels("slower").inc()
            placement_log.info("request %s: peer %s holds %d more prompt tokens; not pulled: predicted TTFT %.3f s "
                               "with the pull, %.3f s without", request.request_id, client.address, held - local,
                               seconds, without)
            return None
        return plan

    async def _pull(self, request: EngineRequest, plan: PullPlan) -> bool:
        client, bs, shape = plan.client, self.handle.block_size, self.handle.block_shape
        assert shape is not None
        rid = f"pull-{next(_ids)}-{request.request_id}"
        started, wire, adopted = time.perf_counter(), 0, 0
        pending: list[Block] = []
        loop = asyncio.get_running_loop()
        done = False
        try:
            queue = await client.pull(m.BlockPull(rid, bs, np.asarray(plan.hashes, "<u8").tobytes()))
            while adopted + len(pending) < len(plan.hashes):
                event = await asyncio.wait_for(queue.get(), self.timeout)
                if not isinstance(event, KVData):
                    done = isinstance(event, m.BlockPullDone)    # (an Error, a PeerError: the pull ends)
                    break
                wire += len(event.payload)
                pending.append(await loop.run_in_executor(self.decoders, decode_block, event, shape, self.rope,
                                                          False))
                if len(pending) >= ADOPT_BLOCKS:
                    adopted, pending = adopted + await self._adopt(plan, adopted, pending, request), []
            else:
                done = True
        except (PeerError, TimeoutError, BadTierFile) as exc:
            placement_log.info("request %s: pull from peer %s ended: %s", request.request_id, client.address,
                               exc or type(exc).__name__)
        finally:
            if not done:
                await client.send(m.Cancel(rid))
            client.finish(rid, wire, time.perf_counter() - started)
        adopted += await self._adopt(plan, adopted, pending, request)
        return self._outcome(request, plan, adopted, wire, time.perf_counter() - started)

    async def _adopt(self, plan: PullPlan, start: int, blocks: list[Block], request: EngineRequest) -> int:
        if not blocks:
            return 0
        return await self.handle.adopt_blocks(plan.hashes[start:start + len(blocks)], request.cache_salt, blocks)

    def _outcome(self, request: EngineRequest, plan: PullPlan, adopted: int, wire: int, seconds: float) -> bool:
        outcome = "pulled" if adopted == len(plan.hashes) else "partial" if adopted else "failed"
        tokens = adopted * self.handle.block_size
        self.metrics.peer_pulls.labels(outcome).inc()
        self.metrics.peer_pull_tokens.inc(tokens)
        self.metrics.peer_pull_bytes.inc(wire)
        placement_log.info("request %s: pulled %d of %d prompt tokens from peer %s in %.3f s (%d bytes; %s): "
                           "predicted TTFT %.3f s with the pull, %.3f s without", request.request_id, tokens,
                           plan.held - plan.local, plan.client.address, seconds, wire, outcome, plan.seconds,
                           plan.without)
        return outcome == "pulled"
