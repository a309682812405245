"""DeepSeek-V2/V3 (and Kimi K2) configuration: the fields of multi-head latent attention (MLA), YaRN
RoPE and the routed MoE, read from a Hugging Face config.json into one msgspec Struct.

Life cycle: `ModelConfig.from_dict` meets a `DeepseekV2ForCausalLM`/`DeepseekV3ForCausalLM`
architecture (whatever its `model_type`: Kimi K2 declares DeepseekV3 with its own), calls
`parse_deepseek(raw, arch, source)` once, keeps the returned `DeepseekConfig` as `ModelConfig.mla`
and takes the generic fields from `generic_fields(raw, mla)`. The model (`deepseek.py`), its
attention (`mla.py`) and the latent KV layout read it from there, read-only. No torch here.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from edgecore.shared.models.config import RopeParams
from edgecore.shared.errors import ConfigError

Pos = Annotated[int, msgspec.Meta(gt=0)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class Fp8Quantization(msgspec.Struct, frozen=True):
    """`quantization_config` of the published fp8 checkpoints (DeepSeek-V3, Kimi K2): float8_e4m3fn linear
    weights, each with a `weight_scale_inv` of one float32 per block of `weight_block_size`."""
    quant_method: Literal["fp8"]
    weight_block_size: Annotated[list[Pos], msgspec.Meta(min_length=2, max_length=2)]
    fmt: Literal["e4m3"] = "e4m3"
    activation_scheme: Literal["dynamic"] = "dynamic"


class DeepseekConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The DeepSeek-specific config.json fields (the generic ones stay in `ModelConfig`)."""
    kv_lora_rank: Pos
    qk_rope_head_dim: Pos
    qk_nope_head_dim: Pos
    v_head_dim: Pos
    q_lora_rank: Pos | None = None
    attention_bias: bool = False
    n_routed_experts: Pos | None = None
    n_shared_experts: NonNeg | None = None
    moe_intermediate_size: Pos | None = None
    num_experts_per_tok: Pos | None = None
    first_k_dense_replace: NonNeg = 0
    moe_layer_freq: Pos = 1
    n_group: Pos | None = None
    topk_group: Pos | None = None
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] | None = None
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    rope_interleave: bool = True
    rope: RopeParams = RopeParams(rope_theta=10000.0)
    fp8_block: tuple[int, int] | None = None     # block-scaled fp8 linear weights: the (rows, cols) of one scale
    version: Literal[2, 3] = 3

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the compressed KV plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Every layer from `first_k_dense_replace` on, as transformers builds them (`moe_layer_freq`, which
        DeepSeek's own code also honoured, is not read there; published checkpoints have 1)."""
        return self.n_routed_experts is not None and layer >= self.first_k_dense_replace

    @property
    def sigmoid_routing(self) -> bool:
        """V3 scores experts by sigmoid (with the correction bias), V2 by softmax: transformers reads no
        `scoring_func`."""
        return self.version == 3

    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's formula)."""
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.rope_type == "yarn" and r.mscale_all_dim:
            assert r.factor is not None             # `_rope` sets it under YaRN
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(raw: dict, source: str) -> RopeParams:
    """The shared `RopeParams` from either config form, `rope_theta` always set; DeepSeek rotates its RoPE part
    plainly or with YaRN only, so any other `rope_type` is an error naming the field."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    scaling = raw.get("rope_scaling") if isinstance(raw.get("rope_scaling"), dict) else None
    fields: dict[str, Any] = {"rope_theta": raw.get("rope_theta") or 10000.0}
    for part in (params, scaling):          # the older `rope_scaling` form wins where both exist
        if part:
            fields.update({k: v for k, v in part.items() if k in RopeParams.__struct_fields__ and v is not None})
            if "type" in part and "rope_type" not in part:
                fields["rope_type"] = part["type"]
    if fields.get("rope_type", "default") not in ("default", "yarn"):
        raise ConfigError(f"{source}: field 'rope_scaling.rope_type' = {fields['rope_type']!r}: DeepSeek models "
                          "take 'default' or 'yarn'")
    try:
        rope = msgspec.convert(fields, RopeParams)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: field 'rope_scaling'/'rope_parameters': {exc}") from None
    if rope.rope_type == "yarn":
        # transformers' standardize_rope_params: a top-level value wins, else the dict's, else max_position_embeddings
        original = raw.get("original_max_position_embeddings") or rope.original_max_position_embeddings or \
            raw.get("max_position_embeddings")
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ConfigError(f"{source}: YaRN rope needs a positive 'original_max_position_embeddings'")
        rope = msgspec.structs.replace(rope, original_max_position_embeddings=original)
        if rope.factor is None:
            factor = raw.get("max_position_embeddings", 0) / rope.original_max_position_embeddings
            rope = msgspec.structs.replace(rope, factor=float(factor))
    return rope


def _fp8_block(raw: dict, source: str) -> tuple[int, int] | None:
    """The scale block of an fp8 checkpoint (None when the weights are not quantized)."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    try:
        q = msgspec.convert(quant, Fp8Quantization)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: field 'quantization_config': {exc} (only block-scaled fp8 e4m3 weights "
                          "with dynamic activations load)") from None
    return q.weight_block_size[0], q.weight_block_size[1]


V3_DEFAULTS = {"n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
               "first_k_dense_replace": 3}


def parse_deepseek(raw: dict, arch: str, source: str = "config.json") -> DeepseekConfig:
    """Validate the DeepSeek fields of a config.json; every bad value is a `ConfigError` naming it."""
    version = 2 if arch == "DeepseekV2ForCausalLM" else 3
    fields = {k: v for k, v in raw.items() if k in DeepseekConfig.__struct_fields__ and v is not None}
    fields.pop("rope", None)
    fields["version"] = version
    if version == 2:
        fields["rope_interleave"] = True          # V2 rotates interleaved pairs (complex form) always
    # As transformers routes: V3 always by sigmoid scores with the correction bias (its scoring_func and
    # topk_method are not read), V2 always by softmax (topk_method greedy or group_limited_greedy).
    if version == 3:
        fields["topk_method"] = "noaux_tc"
        for key, value in V3_DEFAULTS.items():      # transformers' DeepseekV3Config defaults for absent keys
            if key not in raw:
                fields[key] = value
    else:
        fields.setdefault("topk_method", "greedy")
    try:
        cfg = msgspec.convert(fields, DeepseekConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    cfg = msgspec.structs.replace(cfg, rope=_rope(raw, source), fp8_block=_fp8_block(raw, source))
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"{source}: field 'qk_rope_head_dim' = {cfg.qk_rope_head_dim} must be even")
    if cfg.n_routed_experts is not None:
        for key in ("moe_intermediate_size", "num_experts_per_tok"):
            if getattr(cfg, key) is None:
                raise ConfigError(f"{source}: field '{key}' is required with n_routed_experts")
        assert cfg.num_experts_per_tok is not None      # checked just above
        if cfg.num_experts_per_tok > cfg.n_routed_experts:
            raise ConfigError(f"{source}: field 'num_experts_per_tok' exceeds n_routed_experts")
        groups = cfg.n_group or 1
        if cfg.n_routed_experts % groups:
            raise ConfigError(f"{source}: field 'n_group' = {groups} must divide n_routed_experts")
        if groups > 1 and cfg.topk_method != "greedy" and cfg.topk_group is None:
            raise ConfigError(f"{source}: field 'topk_group' is required with n_group = {groups}")
        if (cfg.topk_group or groups) > groups:
            raise ConfigError(f"{source}: field 'topk_group' = {cfg.topk_group} exceeds n_group = {groups}")
        if version == 2 and cfg.topk_method == "noaux_tc":
            raise ConfigError(f"{source}: field 'topk_method' = {cfg.topk_method!r}: DeepSeek-V2 routes by "
                              "'greedy' or 'group_limited_greedy'")
    return cfg


def generic_fields(raw: dict, mla: DeepseekConfig) -> dict:
    """The config with the fields the generic `ModelConfig` parser reads set for MLA: one latent "KV head"
    (shared by every query head), the attention head dimension, and no RoPE scaling (read here)."""
    out = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_parameters")}
    out.update(num_key_value_heads=1, head_dim=mla.qk_head_dim, rope_theta=mla.rope.rope_theta)
    return out
