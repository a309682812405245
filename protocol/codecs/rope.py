"""RoPE in the rotate-half layout, applied or undone on numpy key planes (the codecs code keys un-rotated).

Life cycle: `rotate` builds (and caches per thread, keyed by the RoPE, first position, token and
head count) full-size cos / signed sin tables for a chunk's positions, so that every layer of the
chunk (and every block of it, see equant.py) reuses them. Narrow heads get tables as wide as the
plane (numpy's short inner loops cost more than the arithmetic), wide heads broadcast one row.
"""

from __future__ import annotations

import threading

import numpy as np

from edgecore.protocol.errors import CodecError

_local = threading.local()
_CACHED = 16
_BROADCAST_DIM = 64


def _tables(rope: tuple[float, ...], start: int, tokens: int, heads: int,
            inverse: bool) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin [tokens, heads, dim] float32 (angles in float64; `heads` 1 to broadcast), so that
    rotated = x·cos + swap_halves(x)·sin; forward: (x1·c − x2·s, x2·c + x1·s)."""
    cache = getattr(_local, "rope", None)
    if cache is None:
        cache = _local.rope = {}
    key = (rope, start, tokens, heads, inverse)
    hit = cache.get(key)
    if hit is None:
        ang = np.arange(start, start + tokens, dtype=np.float64)[:, None] * np.asarray(rope, dtype=np.float64)[None]
        cos, sin = np.cos(ang), np.sin(ang)
        sign = 1.0 if inverse else -1.0
        cos = np.concatenate([cos, cos], axis=1).astype(np.float32)[:, None]
        sin = np.concatenate([sign * sin, -sign * sin], axis=1).astype(np.float32)[:, None]
        shape = (tokens, heads, 2 * len(rope))
        hit = (np.ascontiguousarray(np.broadcast_to(cos, shape)), np.ascontiguousarray(np.broadcast_to(sin, shape)))
        if len(cache) >= _CACHED:
            cache.pop(next(iter(cache)))
        cache[key] = hit
    return hit


def rotate(x: np.ndarray, rope: tuple[float, ...], start: int, inverse: bool) -> np.ndarray:
    """Apply (or undo, `inverse`) RoPE in the rotate-half layout to x [layers, tokens, heads, dim] float32
    whose first token is at position `start`: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin). Returns a new
    contiguous array."""
    layers, tokens, heads, dim = x.shape
    half = dim // 2
    if len(rope) != half or dim % 2:
        raise CodecError(f"RoPE has {len(rope)} frequencies, head_dim {dim} needs {half}")
    # Narrow heads: tables as wide as the plane, so each pass is one long loop; wide heads broadcast.
    cos, sin = _tables(rope, start, tokens, heads if dim < _BROADCAST_DIM else 1, inverse)
    pairs = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 2, half)
    swapped_pairs = np.empty_like(pairs)
    swapped_pairs[:, 0], swapped_pairs[:, 1] = pairs[:, 1], pairs[:, 0]
    swapped = swapped_pairs.reshape(x.shape)
    swapped *= sin
    out = pairs.reshape(x.shape) * cos
    out += swapped
    return out
