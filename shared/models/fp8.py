"""Block-scaled fp8 checkpoints (DeepSeek-V3, Kimi K2 as published): dequantized once, at load.

Life cycle: the checkpoint stores each linear weight W as float8_e4m3fn beside `W_scale_inv`, one float32 per
block of `block` = (rows, cols) (128 x 128 in the published ones; the last block of a dimension may be partial,
as for V3's 576-row `kv_a_proj_with_mqa`). `dequantized(weights, block)` wraps the (name, lazy slice) stream a
model loads from: it holds each fp8 weight until its scale arrives (safetensors lists a weight just before its
`_scale_inv`), yields the float32 product `W[i, j] * scale_inv[i // rows, j // cols]` under the weight's name,
and passes every other tensor through untouched. The scales themselves never reach the model. A weight without
its scale, or a scale of the wrong grid, is a `ValueError` naming the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from edgecore.shared.models.layers import WeightSource

SCALE_SUFFIX = "_scale_inv"


def _tensor(source: WeightSource) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     name: str = "weight") -> torch.Tensor:
    """float32 W * scale_inv, each scale covering one (rows, cols) block of W [out, in] (edge blocks partial)."""
    if weight.dim() != 2:
        raise ValueError(f"tensor '{name}': fp8 weight must be 2-D, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"tensor '{name}{SCALE_SUFFIX}': expected shape {grid} for a {rows}x{cols} weight in "
                         f"{block[0]}x{block[1]} blocks, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def dequantized(weights: Iterable[tuple[str, WeightSource]], block: tuple[int, int]
                ) -> Iterator[tuple[str, WeightSource]]:
    """The checkpoint stream with every fp8 weight replaced by its float32 dequantization."""
    weights_fp8: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, source in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name[:-len(SCALE_SUFFIX)]
            if base in weights_fp8:
                yield base, dequantize_block(weights_fp8.pop(base), _tensor(source), block, base)
            else:
                scales[base] = _tensor(source)
        elif _is_fp8(source):
            if name in scales:
                yield name, dequantize_block(_tensor(source), scales.pop(name), block, name)
            else:
                weights_fp8[name] = _tensor(source)
        else:
            yield name, source
    if weights_fp8:
        raise ValueError(f"fp8 tensor '{sorted(weights_fp8)[0]}' has no '{SCALE_SUFFIX}' beside it")
    if scales:
        raise ValueError(f"tensor '{sorted(scales)[0]}{SCALE_SUFFIX}' scales no fp8 weight")


def _is_fp8(source: WeightSource) -> bool:
    if isinstance(source, torch.Tensor):
        return source.dtype == torch.float8_e4m3fn
    get_dtype = getattr(source, "get_dtype", None)
    return get_dtype is not None and get_dtype() == "F8_E4M3"
