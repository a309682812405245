"""Torch KV tensors ↔ the numpy bit planes the protocol's codecs take.

bfloat16/float16 travel as uint16 bits, float32 as uint32 bits, in
[layers, tokens, heads, width] order; conversions are views, not copies. The planes are
those of the model's `KVLayout` (shared/kv/layout.py): K and V per head, or, for MLA, the
latent (kv_lora_rank wide) and the rope key (qk_rope_head_dim wide) of one shared "head".
`codec_rope` gives the RoPE frequencies both ends hand the codecs (keys coded with RoPE removed);
`codec_step_scales` the core's bit allocation (per layer, and per channel where calibrated), from the model
directory's `kv_allocation.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from edgecore.shared.errors import ConfigError

from edgecore.shared.models.rope import rope_inv_freq

if TYPE_CHECKING:
    from edgecore.shared.models.config import ModelConfig

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def to_bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.float32:
        return t.numpy().view(np.uint32)
    return t.view(torch.int16).numpy().view(np.uint16)


def from_bits(bits: np.ndarray, dtype: str) -> torch.Tensor:
    arr = np.ascontiguousarray(bits)
    if dtype == "float32":
        return torch.from_numpy(arr.view(np.float32))
    return torch.from_numpy(arr.view(np.int16)).view(TORCH_DTYPES[dtype])


def codec_rope(config: ModelConfig) -> tuple[float, ...] | None:
    """The RoPE inverse frequencies the codecs may take (codecs/equant.py codes keys with them undone), or
    None where the K plane is not rotate-half keys over the full head_dim (MLA's latent; Llama 4's pairs).
    Core and edge both derive it from the model's config, so both give the codec the same tuple."""
    if config.mla is not None or config.architecture.startswith("Llama4"):
        return None
    inv_freq, _scale = rope_inv_freq(config)
    return tuple(float(f) for f in inv_freq.double())


ALLOCATION_FILE = "kv_allocation.json"


class _Allocation(msgspec.Struct):
    step_scales: dict[str, list[float]]
    channel_scales: dict[str, list[list[float]]] = {}


def codec_step_scales(model_dir: str | Path) -> dict[str, tuple]:
    """The model's KV bit allocation for the encoder: {"k": step multiplier per layer, "v": ...} and, where the
    file has per-channel scales, {"k_channels": per layer a tuple of kv_heads × head_dim multipliers,
    "v_channels": ...}; from `kv_allocation.json` in the model directory (written by bench/kv_rd.py --allocate
    LEVEL [--channels A:B] --write-allocation); {} when there is none. Decoders need none of it: steps travel in
    the payload."""
    path = Path(model_dir) / ALLOCATION_FILE
    if not path.is_file():
        return {}
    try:
        alloc = msgspec.json.decode(path.read_bytes(), type=_Allocation)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}") from None
    bad = [k for k, v in alloc.step_scales.items() if k not in ("k", "v") or not all(0 < x < 1e3 for x in v)]
    if bad:
        raise ConfigError(f"{path}: step_scales needs kinds 'k'/'v' with multipliers in (0, 1000), not {bad}")
    out: dict[str, tuple] = {k: tuple(float(x) for x in v) for k, v in alloc.step_scales.items()}
    for kind, layers in alloc.channel_scales.items():
        widths = {len(row) for row in layers}
        if kind not in ("k", "v") or len(widths) > 1 or not all(0 < x < 1e3 for row in layers for x in row):
            raise ConfigError(f"{path}: channel_scales needs kinds 'k'/'v', each a list of equally long per-layer "
                              f"lists of multipliers in (0, 1000); '{kind}' is not")
        out[f"{kind}_channels"] = tuple(tuple(float(x) for x in row) for row in layers)
    return out
