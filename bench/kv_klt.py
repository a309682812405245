"""Experiment for bench/kv_rd.py `--klt`: an entropy-coded level run in a calibrated per-head basis.

Not a wire codec: it measures what a calibrated transform (as KVTC's) would buy before anyone builds
one. Calibration: the channel covariance of each (kind, layer, head) over windows the evaluation does
not use (keys with RoPE undone), and its eigenvectors. Coding: keys un-rotated, every head's vectors
projected onto its basis, the level's codec on the coefficients (keys coded as un-rotated: one group
per chunk), then the inverse. Both ends would need the same basis (shipped with the model); the bytes
counted are the codec's only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgecore.protocol.codecs import Codec, PlaneInfo, from_float32, to_float32
from edgecore.protocol.codecs.equant import EntropyQuantCodec
from edgecore.protocol.codecs.rope import rotate


def calibrate(planes: list[dict[str, list[np.ndarray]]], rope) -> dict[str, list[np.ndarray]]:
    """planes: per window, per kind, per layer bits [1, tokens, heads, dim] → per kind, per layer the bases
    [heads, dim, dim] (columns: eigenvectors, largest variance first)."""
    bases: dict[str, list[np.ndarray]] = {}
    for kind in "kv":
        for layer in range(len(planes[0][kind])):
            x = np.concatenate([_floats(w[kind][layer], kind, rope) for w in planes], axis=1)[0]  # [T, H, D]
            per_head = []
            for h in range(x.shape[1]):
                w, v = np.linalg.eigh(np.cov(x[:, h].T.astype(np.float64)))
                per_head.append(v[:, ::-1].astype(np.float32))
            bases.setdefault(kind, []).append(np.stack(per_head))
    return bases


def _floats(bits: np.ndarray, kind: str, rope) -> np.ndarray:
    x = to_float32(bits, "bfloat16")
    return rotate(x, rope, 0, inverse=True) if kind == "k" and rope is not None else x


class KLTLevel(Codec):
    """An entropy-coded level on per-head basis coefficients (bench only; see the module docstring)."""

    def __init__(self, codec: EntropyQuantCodec, bases: dict[str, list[np.ndarray]], rope):
        level = dataclasses.replace(codec.level, rotated_key_group=codec.level.group)
        self.codec = EntropyQuantCodec(codec.name, codec.codec_id, level)
        self.bases, self.rope = bases, rope
        self.name, self.codec_id, self.lossless = f"{codec.name}+klt", codec.codec_id, False

    def encode(self, bits, info: PlaneInfo):
        x = _floats(bits, info.kind, self.rope) if info.token_start == 0 else None
        if x is None:
            raise ValueError("the KLT experiment codes whole prompts (token_start 0)")
        coeff = np.einsum("lthd,hde->lthe", x, self.bases[info.kind][info.layer_start])
        return self.codec.encode(from_float32(coeff, "bfloat16"), dataclasses.replace(info, rope=None))

    def decode(self, data, info: PlaneInfo):
        coeff = to_float32(self.codec.decode(data, dataclasses.replace(info, rope=None)), "bfloat16")
        x = np.einsum("lthe,hde->lthd", coeff, self.bases[info.kind][info.layer_start])
        if info.kind == "k" and self.rope is not None:
            x = rotate(x, self.rope, 0, inverse=False)
        return from_float32(x, "bfloat16")
