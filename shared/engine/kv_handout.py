"""The KV a prefill-only request hands out, as `LLMEngine` methods: its slots, its K/V by layer or as slices for
the wire, its full blocks pinned as a named context, its release.

Life cycle: a request added with `prefill_only=True` is computed, then parked (PREFILLED) with its blocks; the
node reads its KV (`read_kv_slices`, by the transfer), may pin its prefix (`pin_prefix`, `commit_prefix`), and
releases it (`release`). Engine thread only, as the rest of the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from edgecore.shared.kv.transfer import KVSlice

if TYPE_CHECKING:
    from edgecore.shared.engine.output import OutputState
    from edgecore.shared.kv.block_manager import BlockManager
    from edgecore.shared.kv.pool import KVPool


class KVHandout:
    requests: dict[str, OutputState]
    pool: KVPool
    block_manager: BlockManager
    runner: Any

    def abort(self, request_id: str) -> bool:
        raise NotImplementedError

    def kv_slots(self, request_id: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        seq = self.requests[request_id].seq
        end = seq.num_computed_tokens if end is None else end
        return self.pool.slots(seq.table.blocks, start, end)

    def read_kv(self, request_id: str, layer: int, start: int = 0, end: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [tokens, kv_heads, head_dim] of one layer for a request's computed tokens."""
        return self.pool.read(layer, self.kv_slots(request_id, start, end))

    def read_kv_slices(self, request_id: str, start: int, end: int) -> list[KVSlice]:
        """Every layer and KV head of tokens [start, end) of a request, as slices (a parallel runner gathers
        them from its ranks, one slice per distinct piece)."""
        blocks = self.requests[request_id].seq.table.blocks
        gather = getattr(self.runner, "read_kv", None)
        if gather is not None:
            return [KVSlice(layer0, start, end, head0, k, v) for layer0, head0, k, v in gather(blocks, start, end)]
        slots = self.pool.slots(blocks, start, end)
        ks, vs = zip(*(self.pool.read(layer, slots) for layer in range(len(self.pool.k))))
        return [KVSlice(0, start, end, 0, torch.stack(ks), torch.stack(vs))]

    def release(self, request_id: str) -> None:
        """Free a parked (prefilled or reserved) request's KV."""
        self.abort(request_id)

    def pin_prefix(self, request_id: str) -> list[int]:
        """Keep a parked request's full, cached blocks resident after it is released (contexts; they are
        cached under the request's salt, so only requests with that salt reuse them: contexts are unsalted)."""
        seq = self.requests[request_id].seq
        full = seq.table.blocks[:seq.table.num_hashed]
        self.block_manager.pin(full)
        return list(full)

    def commit_prefix(self, request_id: str) -> list[int]:
        """A parked request whose KV is complete (computed here or written from outside): register its
        full blocks in the prefix cache, pin them, and release the request. Returns the pinned blocks."""
        seq = self.requests[request_id].seq
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.register_full_blocks(seq.table, seq.token_ids, seq.num_prompt_tokens)
        blocks = self.pin_prefix(request_id)
        self.release(request_id)
        return blocks

    def unpin(self, block_ids: list[int]) -> None:
        self.block_manager.release_blocks(block_ids)
