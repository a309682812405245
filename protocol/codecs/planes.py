"""Exponent / sign+mantissa plane split of IEEE-style floats, as raw bits.

Rotating each value left by one bit moves the sign below the mantissa and
leaves the exponent in the top byte (bfloat16, float32: all 8 exponent bits;
float16: 5 exponent bits + 3 mantissa bits). The top bytes form the exponent
plane — few distinct values, entropy-codes well — and the rest form the
sign+mantissa plane, close to random. Used by the `lossless` KV codec and by
the packed weight format's version 1.

`split_top_byte`/`join_top_byte` cut without the rotation: the top byte keeps
the sign beside the high exponent bits. That codes about 1% worse, but joins
in three whole-word passes instead of six, so the packed weight format
(version 2), which is decoded once per model load, uses it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def split_planes(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bits (uint16/uint32, any shape) → (exponent plane [n] u8, sign+mantissa plane [n, itemsize-1] u8)."""
    size = bits.dtype.itemsize
    width = size * 8
    flat = bits.reshape(-1)
    planes = ((flat << 1) | (flat >> (width - 1))).view(np.uint8).reshape(-1, size)
    return np.ascontiguousarray(planes[:, size - 1]), np.ascontiguousarray(planes[:, : size - 1])


def join_planes(exponent: bytes | memoryview | np.ndarray, mantissa: bytes | memoryview | np.ndarray,
                dtype: npt.DTypeLike, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of split_planes: flat array of `count` values of `dtype` (uint16/uint32), written into
    `out` (a flat array of that dtype) when given."""
    dtype = np.dtype(dtype)
    size = dtype.itemsize
    if size == 2:   # fast path: whole-word shifts, in place, no strided byte writes
        if out is None:
            out = np.empty(count, dtype=np.uint16)
        np.copyto(out, np.frombuffer(exponent, dtype=np.uint8, count=count), casting="unsafe")
        out <<= 8
        out |= np.frombuffer(mantissa, dtype=np.uint8, count=count)
        low = out >> 1
        out <<= 15
        out |= low
        return out
    result = np.empty(count, dtype=dtype)
    planes = result.view(np.uint8).reshape(count, size)
    planes[:, size - 1] = np.frombuffer(exponent, dtype=np.uint8, count=count)
    planes[:, : size - 1] = np.frombuffer(mantissa, dtype=np.uint8, count=count * (size - 1)).reshape(count, size - 1)
    width = size * 8
    result = (result >> 1) | (result << (width - 1))
    if out is not None:
        out[:] = result
        return out
    return result


def split_top_byte(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bits (uint16/uint32, any shape) → (top byte of each value [n] u8, the other bytes [n, itemsize-1] u8)."""
    size = bits.dtype.itemsize
    planes = bits.reshape(-1).view(np.uint8).reshape(-1, size)
    return np.ascontiguousarray(planes[:, size - 1]), np.ascontiguousarray(planes[:, : size - 1])


def join_top_byte(top: bytes | memoryview | np.ndarray, rest: bytes | memoryview | np.ndarray,
                  out: np.ndarray) -> np.ndarray:
    """Inverse of split_top_byte, written into `out` (a flat uint16/uint32 array of the values' count)."""
    count, size = len(out), out.dtype.itemsize
    top = np.frombuffer(top, dtype=np.uint8, count=count)
    rest = np.frombuffer(rest, dtype=np.uint8, count=count * (size - 1))
    if size == 2:
        np.copyto(out, top, casting="unsafe")
        out <<= 8
        out |= rest
        return out
    planes = out.view(np.uint8).reshape(count, size)
    planes[:, size - 1] = top
    planes[:, : size - 1] = rest.reshape(count, size - 1)
    return out
