"""Architecture-specific `config.json` fields, one msgspec Struct per family (no torch here).

Life cycle: `ModelConfig.from_dict` decodes the common fields itself, then asks the architecture
registry (`shared/models/registry.py`) which Struct below holds the family's own fields and decodes
the same JSON object into it (constraints included: a wrong value is a one-line error naming the
field). The model module reads its fields from `config.params`. Each Struct may also say which
attention each layer uses (`layer_attention`), from fields only that family has.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PosInt = Annotated[int, msgspec.Meta(gt=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class MixtralParams(msgspec.Struct, frozen=True):
    """Mixtral: every layer is sparse; softmax over all experts, then top-k, renormalized."""
    num_local_experts: PosInt
    num_experts_per_tok: PosInt


class Qwen3MoeParams(msgspec.Struct, frozen=True, kw_only=True):
    """Qwen3-MoE: sparse on every `decoder_sparse_step`-th layer except `mlp_only_layers` (dense MLP there).
    Published checkpoints say `num_experts`, transformers 5 writes `num_local_experts`."""
    num_experts: PosInt | None = None
    num_local_experts: PosInt | None = None
    num_experts_per_tok: PosInt
    moe_intermediate_size: PosInt
    norm_topk_prob: bool = False
    decoder_sparse_step: PosInt = 1
    mlp_only_layers: list[NonNegInt] = []

    def __post_init__(self) -> None:
        if self.num_experts is None and self.num_local_experts is None:
            raise ValueError("Object missing required field `num_experts`")

    @property
    def experts(self) -> int:
        return self.num_experts or self.num_local_experts or 0

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class QuantizationConfig(msgspec.Struct, frozen=True):
    """Only MXFP4 (gpt-oss as published) is understood; it is dequantized at load."""
    quant_method: str = "mxfp4"
    modules_to_not_convert: list[str] = []


class GptOssParams(msgspec.Struct, frozen=True):
    """gpt-oss: clamped SwiGLU experts with biases, router bias, attention sinks."""
    num_local_experts: PosInt
    num_experts_per_tok: PosInt
    swiglu_alpha: PosFloat = 1.702
    swiglu_limit: PosFloat = 7.0
    quantization_config: QuantizationConfig | None = None


class Llama4Params(msgspec.Struct, frozen=True):
    """Llama 4 text: MoE every `interleave_moe_layer_step` layers (shared expert, sigmoid top-1), chunked
    attention on RoPE layers, NoPE global layers with temperature tuning, L2 q/k norm on RoPE layers."""
    num_local_experts: PosInt
    num_experts_per_tok: PosInt
    intermediate_size_mlp: PosInt
    interleave_moe_layer_step: PosInt = 1
    moe_layers: list[NonNegInt] | None = None
    no_rope_layers: list[Annotated[int, msgspec.Meta(ge=0, le=1)]] | None = None
    no_rope_layer_interval: PosInt = 4
    attention_chunk_size: PosInt | None = None
    use_qk_norm: bool = True
    attn_temperature_tuning: bool | int = True      # published configs say 4 (truthy), transformers true
    attn_scale: float = 0.1
    floor_scale: PosFloat = 8192.0

    def sparse_layers(self, num_layers: int) -> set[int]:
        if self.moe_layers is not None:
            return set(self.moe_layers)
        step = self.interleave_moe_layer_step
        return set(range(step - 1, num_layers, step))

    def uses_rope(self, num_layers: int) -> list[bool]:
        if self.no_rope_layers:          # published configs may hold [] (derived, as transformers does)
            return [bool(x) for x in self.no_rope_layers]
        return [(i + 1) % self.no_rope_layer_interval != 0 for i in range(num_layers)]
