"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) with sparse MoE MLPs on every
`decoder_sparse_step`-th layer except `mlp_only_layers`, which keep a dense MLP.

Life cycle: as `MixtralForCausalLM`, whose MoE block and expert loading it shares; the router is
`mlp.gate`, experts are `mlp.experts.E.{gate,up,down}_proj.weight`, and top-k weights are
renormalized only when `norm_topk_prob`.
"""

from __future__ import annotations

from torch import nn

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.llama import MLP
from edgecore.shared.models.mixtral import MixtralForCausalLM, SparseMoE


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    moe_prefix = "mlp"
    names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        p = config.params
        if not p.is_sparse(layer):
            return MLP(config)
        return SparseMoE(config.hidden_size, p.experts, p.moe_intermediate_size, p.num_experts_per_tok,
                         renormalize=p.norm_topk_prob, hidden_act=config.hidden_act)

    def num_experts(self) -> int:
        return self.config.params.experts
