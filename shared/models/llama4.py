"""Llama 4 (text): MoE every `interleave_moe_layer_step` layers (a shared expert plus sigmoid top-1
routed experts that scale their input), chunked local attention with RoPE (adjacent-pair rotation)
and L2-normalized q/k, and global NoPE layers whose queries are scaled up with position
(attention temperature tuning).

Life cycle: as `LlamaForCausalLM`. `rope_inputs` adds the per-position temperature to (cos, sin);
checkpoint `feed_forward.*` names map to the layer's `mlp`; stacked experts
(`experts.gate_up_proj` [E, H, 2I], gate then up; `experts.down_proj` [E, I, H]) load through
`load_special`. `Llama4ForConditionalGeneration` checkpoints load their `language_model.` part
(the loader strips the prefix; vision weights are skipped).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.attention import AttentionMetadata, paged_attention
from edgecore.shared.models.llama import MLP, Attention, LlamaForCausalLM
from edgecore.shared.models.moe import FusedExperts, act_and_mul
from edgecore.shared.models.rope import apply_rope_pairs, rope_cos_sin
from edgecore.shared.models.row_buckets import bounded_linear

if TYPE_CHECKING:
    from edgecore.shared.models.layers import WeightSource

STACKED = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32 (no learned scale)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class Llama4Attention(Attention):
    def __init__(self, config: ModelConfig, layer: int, global_layer: int):
        super().__init__(config, layer, global_layer)
        p = config.params
        self.use_rope = p.uses_rope(config.num_hidden_layers)[global_layer]
        self.l2_qk = p.use_qk_norm and self.use_rope
        self.tune_temperature = p.attn_temperature_tuning and not self.use_rope
        self.eps = config.rms_norm_eps

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        cos, sin, temperature = rope
        t, d = x.shape[0], self.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, heads + 2 * kv_heads, d)
        qk = qkv[:, :heads + kv_heads]
        if self.use_rope:
            qk = apply_rope_pairs(qk, cos, sin)
        if self.l2_qk:
            qk = l2_norm(qk, self.eps)
        q, k = qk[:, :heads], qk[:, heads:]
        if self.tune_temperature:
            q = (q * temperature).to(q.dtype)
        o = paged_attention(q, k, qkv[:, heads + kv_heads:], self.layer, meta, self.scale, self.form)
        return self.o_proj(o.reshape(t, heads * d))


class Llama4MoE(nn.Module):
    """Shared expert (dense MLP) + routed experts; the router's top-k logits go through a sigmoid and scale
    the routed expert's input."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        p = config.params
        self.router = nn.Linear(config.hidden_size, p.num_local_experts, bias=False)
        self.experts = FusedExperts(p.num_local_experts, config.hidden_size, config.intermediate_size,
                                    act=act_and_mul(config.hidden_act))
        self.shared_expert = MLP(config)
        self.top_k = p.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, ids = torch.topk(bounded_linear(x, self.router.weight), self.top_k, dim=-1)
        weights = torch.sigmoid(values.float()).to(x.dtype)
        return self.shared_expert(x) + self.experts(x, ids, weights, weight_inputs=True)


class Llama4ForCausalLM(LlamaForCausalLM):
    renames = ((".feed_forward.", ".mlp."),)

    def rope_tables(self, config: ModelConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(config, positions, pairs=True)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        cos, sin = super().rope_inputs(positions, dtype)
        p = self.config.params
        temperature = torch.log1p(torch.floor((positions.float() + 1.0) / p.floor_scale)) * p.attn_scale + 1.0
        return cos, sin, temperature[:, None, None]

    def make_attention(self, config: ModelConfig, local: int, layer: int) -> nn.Module:
        return Llama4Attention(config, local, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        p = config.params
        if layer in p.sparse_layers(config.num_hidden_layers):
            return Llama4MoE(config)
        return MLP(config, p.intermediate_size_mlp)

    def load_special(self, name: str, local_name: str, source: WeightSource) -> bool:
        m = STACKED.match(local_name)
        if m is None:
            return False
        value = source if isinstance(source, torch.Tensor) else source[:]
        experts = cast(Llama4MoE, self.get_submodule(m.group(1))).experts      # the stacked tensors' layer
        try:
            for i in range(experts.num_experts):
                if m.group(2) == "gate_up_proj":          # [E, H, 2I]: gate columns, then up columns
                    gate, up = value[i].t().chunk(2, dim=0)
                    experts.load_expert("gate", i, gate)
                    experts.load_expert("up", i, up)
                else:                                     # [E, I, H]
                    experts.load_expert("down", i, value[i].t())
        except (RuntimeError, IndexError) as exc:
            raise ValueError(f"tensor '{name}': {exc}") from None
        return True

    def special_names(self, param_name: str) -> list[str] | None:
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(w13|w2)$", param_name)
        if m is None:
            return None
        return [f"{m.group(1)}.{'gate_up_proj' if m.group(2) == 'w13' else 'down_proj'}"]
