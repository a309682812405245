"""Bit allocation for the entropy-coded KV levels, calibrated for bench/kv_rd.py `--allocate` / `--channels`.

Life cycle: kv_rd.py calibrates on held-out windows the evaluation does not use, wraps a level in
`Allocated` (the multipliers handed to its encoder through PlaneInfo, as a core hands them from the
model's kv_allocation.json), and may write the result to that file. Decoders need none of it.

Two granularities:
* per (kind, layer): `allocation` equalises each layer's share of the KL measured with one layer coded
  at a time (step_i ∝ KL_i^-1/2);
* per (kind, layer, head, channel): `channel_weights` measures how much a channel's coding error reaches
  the layer's output, and `channel_scales` turns that into step multipliers. Keys: the error that matters
  is in q·k; RoPE rotates the pair (c, c + d/2) by one angle in q and k, so the pre-RoPE error energy of a
  pair weighs E[q_c² + q_{c+d/2}²] summed over the query heads sharing the KV head (rotation-invariant,
  so it holds for the pre-RoPE keys the codec codes). Values: channel c of KV head h reaches the output
  through o_proj's columns i·d + c of the query heads i sharing it: weight Σ_i ||W_o[:, i·d + c]||².
  Minimising the weighted MSE at a given rate (reverse water-filling, high-rate regime) gives
  step_c ∝ w_c^-1/2; the codec's step is factor × std_c × multiplier, so the blend step_c ∝ std_c^a · w_c^-b
  is the multiplier std_c^(a−1) · w_c^-b (a = 1, b = 0: today's equal-SNR steps; a = 0, b = 1/2: the
  water-filling optimum), normalised to a geometric mean of 1 per (kind, layer) so that the per-layer
  allocation keeps its meaning, and kept within [1/bound, bound].
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from edgecore.protocol.codecs import Codec, to_float32
from edgecore.protocol.codecs.rope import rotate


class Allocated(Codec):
    """A level with the model's bit allocation: {"k": per-layer multipliers, "v": ..., and optionally
    "k_channels" / "v_channels": per layer, kv_heads × head_dim multipliers} given to the encoder."""

    def __init__(self, codec: Codec, scales: dict[str, tuple], name: str | None = None):
        self.codec, self.scales = codec, scales
        self.name, self.codec_id, self.lossless = name or codec.name, codec.codec_id, False

    def encode(self, bits, info):
        return self.codec.encode(bits, dataclasses.replace(
            info, step_scales=tuple(self.scales.get(info.kind, ())),
            channel_scales=tuple(self.scales.get(f"{info.kind}_channels", ()))))

    def decode(self, data, info):
        return self.codec.decode(data, info)


def allocation(kl: dict[str, float], layers: int, bound: float = 4.0) -> dict[str, tuple[float, ...]]:
    """Step multipliers that equalise each (kind, layer)'s share of the KL (KL_i ∝ a_i·step_i², so step_i ∝
    a_i^-1/2), normalised to a geometric mean of 1 (about the uniform level's rate) and kept within
    [1/bound, bound]."""
    a = {key: max(v, 1e-9) for key, v in kl.items()}
    gm = math.exp(sum(math.log(v) for v in a.values()) / len(a))
    m = {key: min(bound, max(1 / bound, math.sqrt(gm / v))) for key, v in a.items()}
    return {kind: tuple(round(m[f"{kind}{i}"], 3) for i in range(layers)) for kind in "kv"}


@torch.inference_mode()
def channel_weights(engine, make_run, windows, rope) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Prefill each window (make_run(window) → a kv_rd Run) with the query projections captured →
    (weights, stds): per kind, [layers, kv_heads, dim] float64 arrays of the channel weights described in
    the module docstring and of the channels' standard deviations (keys with RoPE undone)."""
    layers = [layer.self_attn for layer in engine.model.model.layers]
    heads, kv_heads, dim = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    q_sq = np.zeros((len(layers), heads, dim))
    count = 0
    originals = [attn.qkv_proj.forward for attn in layers]

    def capture(i, attn, forward):
        def wrapped(x):
            qkv = forward(x)
            q = qkv.view(x.shape[0], -1, dim)[:, :heads]
            if hasattr(attn, "q_norm"):
                q = attn.q_norm.forward(q)
            q_sq[i] += q.double().square().sum(0).numpy()
            return qkv
        return wrapped

    planes = {"k": [[] for _ in layers], "v": [[] for _ in layers]}
    try:
        for i, attn in enumerate(layers):
            attn.qkv_proj.forward = capture(i, attn, originals[i])
        for w in windows:
            run = make_run(w)
            count += run.n
            for kind in "kv":
                for layer, bits in enumerate(run.bits[kind]):
                    x = to_float32(bits, "bfloat16")
                    if kind == "k" and rope is not None:
                        x = rotate(x, rope, 0, inverse=True)
                    planes[kind][layer].append(x[0])
            run.close()
    finally:
        for attn, forward in zip(layers, originals):
            attn.qkv_proj.forward = forward
    group = heads // kv_heads
    half = dim // 2
    eq = (q_sq / count).reshape(len(layers), kv_heads, group, dim).sum(2)     # Σ over the KV head's queries
    w_k = eq + np.roll(eq, half, axis=-1) if rope is not None else eq       # pair energy, both channels
    w_v = np.stack([attn.o_proj.weight.double().square().sum(0).reshape(kv_heads, group, dim).sum(1).numpy()
                    for attn in layers])
    stds = {kind: np.stack([np.concatenate(p, axis=0).astype(np.float64).std(axis=0) for p in planes[kind]])
            for kind in "kv"}
    return {"k": w_k, "v": w_v}, stds


def channel_scales(weights: dict[str, np.ndarray], stds: dict[str, np.ndarray], a: float, b: float,
                   bound: float = 4.0) -> dict[str, tuple[tuple[float, ...], ...]]:
    """Per kind ("k_channels", "v_channels"), per layer, the flat heads × dim step multipliers
    std^(a−1) · w^-b, normalised to a geometric mean of 1 per layer, within [1/bound, bound]."""
    out = {}
    for kind in "kv":
        w = np.maximum(weights[kind], 1e-12)
        s = np.maximum(stds[kind], 1e-12)
        log_m = (a - 1) * np.log(s) - b * np.log(w)
        log_m -= log_m.reshape(len(w), -1).mean(axis=1)[:, None, None]
        m = np.clip(np.exp(log_m), 1 / bound, bound)
        out[f"{kind}_channels"] = tuple(tuple(round(float(x), 4) for x in row.reshape(-1)) for row in m)
    return out
