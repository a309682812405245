"""Mixtral (and the sparse-MoE block Qwen3-MoE shares): the Llama decoder with a routed-experts MLP.
Its per-expert checkpoint loading also serves DeepSeek (`deepseek.py`, its own MoE as `moe_class`).

Life cycle: as `LlamaForCausalLM`; `make_mlp` builds a `SparseMoE` (router + `FusedExperts`) on
sparse layers; `load_special` fills the stacked expert weights one checkpoint tensor at a time
(`...experts.E.w1/w2/w3.weight` for Mixtral, `...experts.E.gate_proj/up_proj/down_proj.weight`
for Qwen3-MoE), each rank reading only its shard of the intermediate dimension.
Routing: softmax over all experts in float32, top-k, renormalized (Mixtral always; Qwen3-MoE when
`norm_topk_prob`), as transformers.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.llama import LlamaForCausalLM
from edgecore.shared.models.moe import FusedExperts, act_and_mul, softmax_topk
from edgecore.shared.models.row_buckets import bounded_linear

if TYPE_CHECKING:
    from edgecore.shared.models.layers import WeightSource

EXPERT = re.compile(r"^(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


class SparseMoE(nn.Module):
    """Router (a replicated [E, H] linear) + experts; forward x [T, H] → [T, H]."""

    def __init__(self, hidden: int, experts: int, intermediate: int, top_k: int, renormalize: bool,
                 hidden_act: str = "silu"):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = FusedExperts(experts, hidden, intermediate, act=act_and_mul(hidden_act))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(bounded_linear(x, self.gate.weight), self.top_k, self.renormalize)
        return self.experts(x, ids, weights)


class MixtralForCausalLM(LlamaForCausalLM):
    moe_prefix = "block_sparse_moe"
    names = {"w1": "gate", "w3": "up", "w2": "down"}
    moe_class: type[nn.Module] = SparseMoE     # the MLP whose `experts` the per-expert tensors fill

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        p = config.params
        return SparseMoE(config.hidden_size, p.num_local_experts, config.intermediate_size, p.num_experts_per_tok,
                         renormalize=True, hidden_act=config.hidden_act)

    def num_experts(self) -> int:
        return self.config.params.num_local_experts

    # ---- loading ----------------------------------------------------------------------------
    def _moe(self, local_name: str) -> FusedExperts | None:
        m = EXPERT.match(local_name)
        if m is None:
            return None
        mlp = self.get_submodule(m.group(1) + "mlp")
        return cast(FusedExperts, mlp.experts) if isinstance(mlp, self.moe_class) else None   # as every `moe_class`

    def load_special(self, name: str, local_name: str, source: WeightSource) -> bool:
        if f".{self.moe_prefix}.gate." in local_name:     # Mixtral's router lives under block_sparse_moe
            self._load_one(name, self.get_parameter(local_name.replace(self.moe_prefix, "mlp")), source, None, None)
            return True
        experts = self._moe(local_name)
        m = EXPERT.match(local_name)
        if experts is None or m is None or m.group(3) not in self.names:
            return False
        try:
            experts.load_expert(self.names[m.group(3)], int(m.group(2)), source)
        except RuntimeError as exc:        # a shape that does not fit
            raise ValueError(f"tensor '{name}': {exc}") from None
        return True

    def special_names(self, param_name: str) -> list[str] | None:
        m = re.match(r"^(model\.layers\.\d+\.)mlp\.(experts\.(w13|w2)|gate\.weight)", param_name)
        if m is None:
            return None
        base = m.group(1) + self.moe_prefix
        if m.group(2) == "gate.weight":
            return [f"{base}.gate.weight"]
        wanted = ("gate", "up") if m.group(3) == "w13" else ("down",)
        ckpt = [c for c, n in self.names.items() if n in wanted]
        return [f"{base}.experts.{e}.{c}.weight" for e in range(self.num_experts()) for c in ckpt]
