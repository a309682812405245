"""Quantization codes and steps as bytes: 4-bit codes two per byte, steps as one-byte log codes.

Life cycle: stateless helpers the quantizing codecs (equant.py, quant.py) call while encoding and
decoding a plane; packed arrays live in the thread's scratch arrays (base.py).
"""

from __future__ import annotations

import numpy as np

from edgecore.protocol.codecs.base import scratch

# Log-coded steps (flag bit 2): one byte per step, 2^(1/LOG_STEP_RES) apart (9% at most above the step the
# encoder chose: the level's factors absorb it), from 2^((1 − LOG_STEP_ZERO)/LOG_STEP_RES) ≈ 5.2e-7 to ≈ 1878;
# a plane with a nonzero step outside that range sends float16 steps.
LOG_STEP_RES, LOG_STEP_ZERO = 8, 168


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes < 16 → two per byte, the first in the low nibble (an odd count is padded with code 8).
    Returns a per-thread scratch array, valid until this thread's next call."""
    if codes.size % 2:
        codes = np.append(codes, np.uint8(8))
    pairs = codes.view(np.uint16)            # little-endian: first code in the low byte
    tmp = scratch("pack", pairs.shape, np.uint16)
    np.right_shift(pairs, 4, out=tmp)
    tmp |= pairs
    out = scratch("packed", pairs.shape, np.uint8)
    np.copyto(out, tmp, casting="unsafe")
    return out


def unpack_nibbles(data: bytes | memoryview, n: int) -> np.ndarray:
    """Inverse of pack_nibbles: the first n codes (a per-thread scratch array, valid until the next call)."""
    src = np.frombuffer(data, dtype=np.uint8)
    packed, tmp = scratch("unpack", src.shape, np.uint16), scratch("unpack_t", src.shape, np.uint16)
    np.copyto(packed, src)
    np.left_shift(packed, 4, out=tmp)
    packed |= tmp
    packed &= 0x0F0F
    return packed.view(np.uint8)[:n]


def _step_table() -> np.ndarray:
    table = np.exp2((np.arange(256, dtype=np.float64) - LOG_STEP_ZERO) / LOG_STEP_RES).astype(np.float32)
    table[0] = 0.0
    table.flags.writeable = False
    return table


# The float32 step of every code, from one float64 computation: encoder and decoder read the same values.
STEPS = _step_table()


def log_step_codes(step: np.ndarray) -> np.ndarray | None:
    """Steps → uint8 codes s with STEPS[s] ≥ step (rounded up: the guard holds), s = 0 for a zero step; None
    when a step is not finite or a nonzero one is outside the codes' range (the encoder then sends floats)."""
    if not np.isfinite(step).all():
        return None
    s64 = step.astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(s64) * LOG_STEP_RES) + LOG_STEP_ZERO
    e = np.where(s64 > 0, e, 0)
    if not (e.max(initial=0) <= 255 and (e[s64 > 0] >= 1).all()):
        return None
    codes = e.astype(np.uint8)
    low = (STEPS[codes] < step) & (codes < 255)      # float32 rounding of the table: one code up
    codes[low] += 1
    if (STEPS[codes] < step).any():
        return None
    return codes


def log_steps(codes: np.ndarray) -> np.ndarray:
    """uint8 step codes → float32 steps (code 0: a zero step)."""
    return STEPS[codes]
