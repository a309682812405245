"""Cached prefix blocks copied out of one engine's pool and into another's: KV pulled from a peer edge.

Engine thread only (`EngineThread.pool_blocks` / `adopt_blocks` run these between steps).
Life cycle of a pull (edge/peer_pull.py asks, edge/peer_server.py answers):
1. At the peer, `pool_blocks(hashes)`: the leading run of the asked chained block hashes that its prefix cache
   holds, each block's K/V copied out of the pool (all layers; a quantized pool's blocks read back as floats),
   at most `max_bytes` of them per call (the server asks again for the rest), so a long prefix never sits in
   memory at once. The copies are the peer's own from then on: the pool may reuse the blocks at the next step.
2. The copies travel as KVChunks (one per block, a wire codec) and are decoded at the asking edge.
3. There, `adopt_blocks(hashes, salt, blocks)`: each block is registered in the prefix cache under its hash
   (`BlockManager.adopt`, as the disk tier's blocks are) and its K/V written into the pool, then released:
   the blocks are cached and evictable, exactly as if this engine had computed them, so the request that
   follows is admitted with them as its cached prefix. A block already cached is kept as it is; a pool with no
   free block ends the run (the rest is computed, never wrong).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgecore.shared.kv.block_manager import NoFreeBlocks

if TYPE_CHECKING:
    from edgecore.shared.engine.engine import LLMEngine

Block = tuple[torch.Tensor, torch.Tensor]      # K, V of one block: [layers, tokens, heads, width]


def pool_blocks(engine: LLMEngine, hashes: list[int], max_bytes: int) -> list[Block]:
    """Copies of the cached blocks under the leading `hashes` the prefix cache holds (at least one block when it
    holds the first, then no more than `max_bytes` of K/V)."""
    bm, pool = engine.block_manager, engine.pool
    out: list[Block] = []
    if pool.layout.latent:          # (an MLA pool's latent blocks are not shared)
        return out
    size = 0
    for h in hashes:
        bid = bm.cached.get(h)
        if bid is None or (out and size >= max_bytes):
            break
        slots = pool.slots([bid], 0, bm.block_size)
        planes = [pool.read(layer, slots) for layer in range(len(pool.k))]
        k = torch.stack([kv[0] for kv in planes]).cpu()        # (stacked: new tensors, not views of the pool)
        v = torch.stack([kv[1] for kv in planes]).cpu()
        out.append((k, v))
        size += k.nbytes + v.nbytes
    return out


def adopt_blocks(engine: LLMEngine, hashes: list[int], salt: str | None, blocks: list[Block]) -> int:
    """Cache `blocks` under `hashes` (a run of a prompt's chained hashes, its earlier blocks cached here already);
    how many are now cached."""
    bm, pool = engine.block_manager, engine.pool
    if not bm.caching or pool.layout.latent:
        return 0
    taken: list[int] = []
    try:
        for block_hash, (k, v) in zip(hashes, blocks):
            try:
                bid, fresh = bm.adopt(block_hash, salt)
            except NoFreeBlocks:
                break
            taken.append(bid)
            if fresh:
                slots = pool.slots([bid], 0, bm.block_size)
                k, v = k.to(pool.device), v.to(pool.device)
                for layer in range(len(pool.k)):
                    pool.write(layer, slots, k[layer], v[layer])
    finally:
        bm.release_blocks(taken)
    return len(taken)
