"""Rotary position embeddings as pure functions: inverse frequencies (default, linear, llama3, yarn),
cos/sin tables, and the rotation layouts (halves, as Llama/Qwen/gpt-oss; adjacent pairs, as Llama 4;
halves or pairs gathered into halves over half-width tables, as DeepSeek's MLA).

Life cycle: a model builds its float32 tables once (`rope_cos_sin`) for every position it can see,
then each step indexes them by position and rotates q and k with `apply_rope` (tables from
`rope_cos_sin`) or `apply_rope_pairs` (tables from `rope_cos_sin(..., pairs=True)`).
"""

from __future__ import annotations

import math

import torch

from edgecore.shared.models.config import ModelConfig, RopeParams, RopeScaling


def _yarn(config: ModelConfig, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    return yarn(inv_freq, config.head_dim, config.rope_theta, config.rope_scaling)


def yarn(inv_freq: torch.Tensor, dim: int, base: float, s: RopeScaling | RopeParams) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): interpolate low frequencies, keep high ones,
    a linear ramp between; cos/sin scaled by the attention factor. `s`: the scaling fields (factor,
    beta_fast/slow, original_max_position_embeddings, mscale, mscale_all_dim, attention_factor, truncate)
    of a `RopeScaling` or of the `RopeParams` DeepSeek keeps."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, original = s.factor, s.original_max_position_embeddings
    assert factor is not None and original is not None     # set under YaRN by both config readers
    attention = s.attention_factor
    if attention is None:
        attention = (mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast or 32.0), correction_dim(s.beta_slow or 1.0)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv, float(attention)


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """Unscaled inverse frequencies [dim/2]: base^(-2i/dim)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] with the config's scaling, and the cos/sin scale (1 except yarn)."""
    inv_freq = default_inv_freq(config.head_dim, config.rope_theta)
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif scaling.rope_type == "yarn":
        return _yarn(config, inv_freq)
    return inv_freq, 1.0


def rope_cos_sin(config: ModelConfig, max_positions: int, pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [max_positions, head_dim] in float32.

    Halves layout (default): HF's, with the first half of sin negated so that rotate-half becomes one
    roll: x*cos + roll(x)*sin, bit-identical to HF. Pairs layout: each frequency repeated for its two
    adjacent dimensions, sin negated on the even ones (x*cos + swap(x)*sin)."""
    inv_freq, scale = rope_inv_freq(config)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    if pairs:
        emb = freqs.repeat_interleave(2, dim=-1)
        cos, sin = emb.cos() * scale, emb.sin() * scale
        sin[:, 0::2].neg_()
        return cos, sin
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    sin[:, : sin.shape[1] // 2].neg_()
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, signed sin: [T, 1, D]. roll(x) = cat(x2, x1), so roll(x) * sin = cat(-x2, x1) * |sin|."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair rotation (complex multiply of (x0, x1) pairs): x*cos + (x1, x0)*sin, sin signed."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * sin


def apply_rope_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) when `interleaved`, else (x[i], x[i+d/2]); x [..., d], cos/sin [..., d/2]
    (one angle per pair, unsigned) broadcast. The result holds the pairs' first members, then their second
    ones (both layouts), as transformers' DeepSeek after its interleave permutation."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
