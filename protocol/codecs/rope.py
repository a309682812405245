"""RoPE in the rotate-half layout, applied or undone on numpy key planes (the codecs code keys un-rotated).

Life cycle: `rotate` builds (and caches per thread, keyed by the RoPE, first position, token and
head count) flat cos / signed sin tables for a chunk's positions, so that every layer of the
chunk (and every block of it, see equant.py) reuses them.

Speed: a head's halves are partners, `half` values apart in the flat plane, so the rotation is
x·cos + x[+half]·sin_lo + x[−half]·sin_hi over whole contiguous arrays (sin_lo is zero on second
halves, sin_hi on first halves): five long loops, no strided half-head slices (numpy's short
inner loops cost more than the arithmetic at head_dim 32).
"""

from __future__ import annotations

import threading

import numpy as np

from edgecore.protocol.codecs.base import scratch
from edgecore.protocol.errors import CodecError

_local = threading.local()
_CACHED = 16


def _tables(rope: tuple[float, ...], start: int, tokens: int, heads: int,
            inverse: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat cos, sin_lo, sin_hi [tokens·heads·dim] float32 (angles in float64), so that rotated =
    x·cos + x[i + half]·sin_lo + x[i − half]·sin_hi; forward: (x1·c − x2·s, x2·c + x1·s)."""
    cache = getattr(_local, "rope", None)
    if cache is None:
        cache = _local.rope = {}
    key = (rope, start, tokens, heads, inverse)
    hit = cache.get(key)
    if hit is None:
        ang = np.arange(start, start + tokens, dtype=np.float64)[:, None] * np.asarray(rope, dtype=np.float64)[None]
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        sign = np.float32(1.0 if inverse else -1.0)
        zero = np.zeros_like(sin)
        shape = (tokens, heads, 2 * len(rope))
        hit = tuple(np.ascontiguousarray(np.broadcast_to(np.concatenate(pair, axis=1)[:, None], shape)).reshape(-1)
                    for pair in ((cos, cos), (sign * sin, zero), (zero, -sign * sin)))
        if len(cache) >= _CACHED:
            cache.pop(next(iter(cache)))
        cache[key] = hit
    return hit


def rotate(x: np.ndarray, rope: tuple[float, ...], start: int, inverse: bool, out: np.ndarray | None = None) -> np.ndarray:
    """Apply (or undo, `inverse`) RoPE in the rotate-half layout to x [layers, tokens, heads, dim] float32
    whose first token is at position `start`: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin). Writes into
    `out` (float32, x's shape, not x itself) when given, else into a new array; returns it."""
    layers, tokens, heads, dim = x.shape
    half = dim // 2
    if len(rope) != half or dim % 2:
        raise CodecError(f"RoPE has {len(rope)} frequencies, head_dim {dim} needs {half}")
    cos, sin_lo, sin_hi = _tables(rope, start, tokens, heads, inverse)
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(layers, -1)
    if out is None:
        out = np.empty(x.shape, dtype=np.float32)
    rows = out.reshape(layers, -1)
    n = flat.shape[1]
    tmp = scratch("rope", (max(n - half, 0),), np.float32)
    for src, dst in zip(flat, rows):
        np.multiply(src, cos, out=dst)
        if n > half:
            np.multiply(src[half:], sin_lo[:-half], out=tmp)
            dst[:-half] += tmp
            np.multiply(src[:-half], sin_hi[half:], out=tmp)
            dst[half:] += tmp
    return out
