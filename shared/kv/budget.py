"""KV cache sizing: a memory budget in, a number of blocks out, and the line a deployment prints about it.

Life cycle: a node's CLI reads `--kv-cache-memory SIZE` (or an explicit `--kv-blocks N`), and once the model's
config and dtype are known, `kv_blocks(...)` turns the budget into whole blocks of `block_size` tokens for
this process (a tensor-parallel rank holds its share of the KV heads, so the same budget holds more blocks
per rank); `describe(...)` is the start-up line that says what that gives: tokens, bytes, bytes per token.
The pool itself (`KVPool`) maps its memory lazily on CPU, so a budget is a ceiling on resident memory, not
what a fresh node holds: pages become resident as the cache first fills them, and without a bound sustained
unique traffic fills them all (a never-touched block is preferred to evicting a cached prefix).
`--kv-resident-memory SIZE` turns into `CacheConfig.resident_blocks` the same way (at most the budget's
blocks): past it the block manager evicts cached prefixes before touching new pages (shared/kv/block_manager.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgecore.shared.models.config import ModelConfig

DEFAULT_KV_CACHE_MEMORY = "2GiB"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000 ** 2, "mb": 1000 ** 2,
          "mib": 1 << 20, "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1000 ** 4, "tb": 1000 ** 4,
          "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1000000' → bytes; ValueError naming the accepted forms otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"'{text}' is not a size (e.g. 512MiB, 2GiB, 1.5GB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def bytes_per_token(config: ModelConfig, value_bytes: float, tp: int = 1) -> int:
    """KV bytes one token takes in one process: all layers, this rank's share of the KV heads (MLA's latent is
    not split across ranks)."""
    total = config.kv_bytes_per_token(value_bytes)
    if config.mla is not None or tp == 1:
        return total
    return total // min(tp, config.num_key_value_heads)


def kv_blocks(config: ModelConfig, value_bytes: float, block_size: int, memory: int, tp: int = 1) -> int:
    """Blocks of `block_size` tokens that fit in `memory` bytes; ValueError when not even one does."""
    per_block = block_size * bytes_per_token(config, value_bytes, tp)
    blocks = memory // per_block
    if blocks < 1:
        raise ValueError(f"a KV cache of {memory} bytes holds no block: one block of {block_size} tokens takes "
                         f"{per_block} bytes for this model")
    return blocks


def describe(config: ModelConfig, value_bytes: float, block_size: int, num_blocks: int, tp: int = 1,
             resident_blocks: int | None = None) -> str:
    per_token = bytes_per_token(config, value_bytes, tp)
    tokens = num_blocks * block_size
    bound = "" if resident_blocks is None or resident_blocks >= num_blocks else (
        f"; resident bound {resident_blocks} blocks = {_human(resident_blocks * block_size * per_token)} "
        "(cached prefixes are evicted before new pages are touched)")
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens = {tokens:,} tokens, "
            f"{_human(tokens * per_token)} ({per_token:,} bytes per token at {value_bytes:.3g} bytes per value"
            f"{f', this rank of {tp}' if tp > 1 else ''}){bound}")


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
