"""A quantized KV cache tensor (`--kv-cache-dtype int8|fp8`): values in one byte, a scale per token and head.

Life cycle: `KVPool` makes one `QuantCache` per layer for K and one for V instead of float tensors when its
`CacheConfig.kv_dtype` is set. Attention writes new K/V through `write` (each token's head vector scaled by its
largest magnitude: int8 symmetric, round to nearest, in [-127, 127]; fp8 e4m3, in [-448, 448]) and reads
through `gather` (slots), `gather_blocks` (whole blocks of a block table) and `span` (consecutive slots), which
return float tensors in the model's dtype; the pool's `read`/`write` (KV transfer, the disk tier) go through
the same calls, so the wire and the tier see float KV. One value takes one byte plus 2 / head_dim bytes of
float16 scale: about twice the tokens per GiB of a bf16 pool (four times a float32 one).

Memory as the pool's: on CPU the byte and scale arrays are anonymous maps, zero until touched (a zero scale
reads as zeros).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_STORED = {"int8": torch.int8, "fp8": torch.uint8}       # fp8 kept as its bytes (CPU copies lack float8 kernels)
_LIMIT = {"int8": 127.0, "fp8": 448.0}
_TINY = 2.0 ** -14        # the smallest scale kept (float16's smallest normal)


class QuantCache:
    def __init__(self, slots: int, heads: int, dim: int, kind: str, dtype: torch.dtype,
                 zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]):
        """`dtype`: the model's, which reads return; `zeros(shape, dtype)`: the pool's allocator."""
        if kind not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {kind!r}: one of {', '.join(KV_DTYPES)}")
        self.kind, self.dtype, self.limit = kind, dtype, _LIMIT[kind]
        self.data = zeros((slots, heads, dim), _STORED[kind])
        self.scale = zeros((slots, heads), torch.float16)
        self.shape = self.data.shape
        # fp8 bytes → values through a 256-entry table: 3x faster on CPU than torch's float8 conversion
        self.table = None if kind != "fp8" else torch.nan_to_num(
            torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype), nan=0.0).to(self.data.device)

    def element_size(self) -> int:
        return 1

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 2 * self.scale.numel()

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, heads, dim] → (bytes, float16 scales [tokens, heads])."""
        x = x.float()
        scale = (x.abs().amax(-1) / self.limit).clamp_(min=_TINY).half()
        q = x / scale.float().unsqueeze(-1)
        if self.kind == "int8":
            return q.round_().clamp_(-127, 127).to(torch.int8), scale
        return q.clamp_(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), scale

    def _dequant(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            values = self.table.index_select(0, data.reshape(-1).int()).view(data.shape)
        else:
            values = data.to(self.dtype)
        return values * scale.to(self.dtype).unsqueeze(-1)

    def write(self, slots: torch.Tensor, x: torch.Tensor, heads: slice | None = None) -> None:
        q, scale = self.quantize(x)
        if heads is None:
            self.data.index_copy_(0, slots, q)
            self.scale.index_copy_(0, slots, scale)
        else:
            self.data[slots, heads] = q
            self.scale[slots, heads] = scale

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), heads, dim] in the model's dtype."""
        return self._dequant(self.data.index_select(0, slots), self.scale.index_select(0, slots))

    def gather_blocks(self, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
        """Whole blocks in `blocks`' order: [len(blocks) * block_size, heads, dim] in the model's dtype."""
        heads, dim = self.shape[1], self.shape[2]
        data = self.data.view(-1, block_size, heads, dim).index_select(0, blocks).view(-1, heads, dim)
        scale = self.scale.view(-1, block_size, heads).index_select(0, blocks).view(-1, heads)
        return self._dequant(data, scale)

    def span(self, start: int, length: int) -> torch.Tensor:
        return self._dequant(self.data[start:start + length], self.scale[start:start + length])

    def __getitem__(self, index: slice) -> torch.Tensor:
        """Consecutive slots, dequantized (what the disk tier's spill copies)."""
        return self._dequant(self.data[index], self.scale[index])

    def zero(self, slots: torch.Tensor) -> None:
        self.data.index_fill_(0, slots, 0)
        self.scale.index_fill_(0, slots, 0)


Cache = torch.Tensor | QuantCache


def write(cache: Cache, slots: torch.Tensor, x: torch.Tensor) -> None:
    if isinstance(cache, QuantCache):
        cache.write(slots, x)
    else:
        cache.index_copy_(0, slots, x)


def gather(cache: Cache, slots: torch.Tensor) -> torch.Tensor:
    return cache.gather(slots) if isinstance(cache, QuantCache) else cache.index_select(0, slots)


def gather_blocks(cache: Cache, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    if isinstance(cache, QuantCache):
        return cache.gather_blocks(blocks, block_size)
    heads, dim = cache.shape[1], cache.shape[2]
    return cache.view(-1, block_size, heads, dim).index_select(0, blocks).view(-1, heads, dim)


def span(cache: Cache, start: int, length: int) -> torch.Tensor:
    return cache.span(start, length) if isinstance(cache, QuantCache) else cache[start:start + length]
