"""The paged KV pool: the tensors behind the block manager's block ids.

Life cycle: allocated once at engine start from the model's `KVLayout` (shared/kv/layout.py):
for per-head layouts one K and one V tensor per layer, shaped
[num_blocks * block_size, kv_heads, head_dim]; for the MLA latent layout one tensor per layer,
[num_blocks * block_size, 1, kv_lora_rank + qk_rope_head_dim], whose two planes (latent, rope)
`k` and `v` are views of (a flat slot index = block_id * block_size + offset). Attention writes and reads through slots;
`read`/`write` move one sequence's K/V for a range of layers and tokens in and
out (used by the KV sender and receiver of disaggregated serving).

With `CacheConfig.kv_dtype` ("int8", "fp8") each layer's K and V is a `QuantCache` (shared/kv/quant_cache.py):
a byte per value and a scale per token and head, `read`/`write` still in the model's dtype (MLA's latent
layout is not quantized).

Memory: on CPU each tensor is an anonymous memory map, zero-filled by the kernel page by page on first
touch, so the pool's resident size grows with the blocks actually used rather than its capacity
(`--kv-cache-memory` is a ceiling). Zeros matter: attention reads whole blocks, and a masked NaN from
unwritten memory would still poison a softmax.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

from edgecore.shared.models.config import CacheConfig, ModelConfig
from edgecore.shared.errors import ConfigError
from edgecore.shared.kv.layout import KVLayout
from edgecore.shared.kv.quant_cache import Cache, QuantCache, gather


class KVPool:
    def __init__(self, config: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: str,
                 num_kv_heads: int | None = None, num_layers: int | None = None):
        self.block_size = cache.block_size
        self.num_slots = cache.num_blocks * cache.block_size
        self.layout = layout = KVLayout.of(config, num_kv_heads)
        layers = num_layers if num_layers is not None else config.num_hidden_layers
        self.kv_dtype = cache.kv_dtype      # "int8" / "fp8": a byte per value and a scale per token and head
        self.k: list = []
        self.v: list = []
        if self.kv_dtype is not None:
            if layout.latent:
                raise ConfigError(f"--kv-cache-dtype {self.kv_dtype}: not for MLA's latent KV cache")
            self.k = [QuantCache(self.num_slots, layout.heads, layout.k_dim, self.kv_dtype, dtype,
                                 lambda s, d: _zeros(s, d, device)) for _ in range(layers)]
            self.v = [QuantCache(self.num_slots, layout.heads, layout.v_dim, self.kv_dtype, dtype,
                                 lambda s, d: _zeros(s, d, device)) for _ in range(layers)]
        elif layout.latent:
            shape = (self.num_slots, 1, layout.k_dim + layout.v_dim)
            self.latent = [_zeros(shape, dtype, device) for _ in range(layers)]
            self.k = [t[..., :layout.k_dim] for t in self.latent]
            self.v = [t[..., layout.k_dim:] for t in self.latent]
        else:
            shape = (self.num_slots, layout.heads, layout.k_dim)
            self.k = [_zeros(shape, dtype, device) for _ in range(layers)]
            self.v = [_zeros(shape, dtype, device) for _ in range(layers)]
        self.dtype, self.device = dtype, device
        self.block_bytes = self.bytes // cache.num_blocks if cache.num_blocks else 0

    @property
    def layers(self) -> list[tuple[Cache, Cache | None]]:
        """What attention reads per layer: (K, V) caches, or (the whole latent cache, None) for MLA."""
        if self.layout.latent:
            return [(t, None) for t in self.latent]
        return list(zip(self.k, self.v))

    def slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of token positions [start, end) of a sequence with these blocks."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [tokens, kv_heads, head_dim] at these slots (a copy; a quantized pool's in the model's dtype);
        latent, rope [tokens, 1, width] for MLA."""
        return gather(self.k[layer], slots), gather(self.v[layer], slots)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_start: int = 0) -> None:
        """Write K, V [tokens, heads, head_dim]; a slice of the KV heads starting at `head_start` is allowed
        (KV from a tensor-parallel core arrives per head range)."""
        if k.shape[-1] != self.k[layer].shape[-1] or v.shape[-1] != self.v[layer].shape[-1]:
            raise ValueError(f"KV planes of width {k.shape[-1]}, {v.shape[-1]} do not fit this pool's "
                             f"{self.k[layer].shape[-1]}, {self.v[layer].shape[-1]}")
        if self.kv_dtype is not None:
            whole = head_start == 0 and k.shape[1] == self.k[layer].shape[1]
            heads = None if whole else slice(head_start, head_start + k.shape[1])
            self.k[layer].write(slots, k, heads)
            self.v[layer].write(slots, v, heads)
        elif head_start == 0 and k.shape[1] == self.k[layer].shape[1]:
            self.k[layer].index_copy_(0, slots, k.to(self.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.dtype))
        else:
            heads = slice(head_start, head_start + k.shape[1])
            self.k[layer][slots, heads] = k.to(self.dtype)
            self.v[layer][slots, heads] = v.to(self.dtype)

    def clear(self, layer: int, slots: torch.Tensor) -> None:
        """Zero K and V of one layer at these slots (positions that were never written)."""
        for t in (self.k[layer], self.v[layer]):
            if isinstance(t, QuantCache):
                t.zero(slots)
            else:
                t.index_fill_(0, slots, 0)

    @property
    def bytes(self) -> int:
        tensors = self.latent if self.layout.latent else self.k + self.v
        return sum(t.nbytes if isinstance(t, QuantCache) else t.numel() * t.element_size() for t in tensors)


# No swap reserved for the whole capacity up front (Python < 3.12 lacks the constant; Linux's value).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor; on CPU backed by an anonymous memory map, resident only where touched."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the map alive; the map is unmapped when the last view of it goes.
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)
