"""DeepSeek-V2/V3 decoder (and Kimi K2, which declares DeepseekV3ForCausalLM): multi-head latent attention
(`mla.py`) and a routed mixture of experts with shared experts, over a paged cache of latent vectors.

Life cycle: as `LlamaForCausalLM`, whose decoder layer, dense MLP, forward, logits and loading it reuses
through the hooks: `make_attention` builds an `MLAttention`, `make_mlp` a dense `MLP` on the first
`first_k_dense_replace` layers and a `MoE` on the others (V2's dense MLPs with `mlp_bias`), `rope_tables`
the half-width YaRN tables of the rotary part, and the routed experts (`mlp.experts.E.{gate,up,down}_proj`)
load one matrix at a time into `FusedExperts` through the expert loading Qwen3-MoE uses (`mixtral.py`).

Routing, as transformers' routers (the reference; DeepSeek's own code differs in the corner cases noted):
the router scores experts (V3: sigmoid, plus `e_score_correction_bias` for the choice only; V2: softmax),
limits the choice to the `topk_group` best of `n_group` expert groups, takes the top `num_experts_per_tok`,
renormalises them with `norm_topk_prob` on V3 only (even one expert; DeepSeek's code skips one, and V2's
honoured the flag) and scales by `routed_scaling_factor`; the shared experts run on every token.

Loading: published fp8 checkpoints (`quantization_config`, block-scaled float8_e4m3fn linear weights) are
dequantized tensor by tensor as they stream in (`fp8.py`); multi-token-prediction layers (`num_nextn_predict_layers`,
stored as layers `num_hidden_layers`..) are not used for decoding and are skipped with one logged note.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.fp8 import dequantized
from edgecore.shared.models.llama import MLP
from edgecore.shared.models.mixtral import MixtralForCausalLM
from edgecore.shared.models.mla import MLAttention, rope_cos_sin
from edgecore.shared.models.mla_config import DeepseekConfig
from edgecore.shared.models.moe import FusedExperts, act_and_mul

if TYPE_CHECKING:
    from edgecore.shared.models.layers import WeightSource

log = logging.getLogger("edgecore.models")


class Router(nn.Module):
    """Expert choice of every token: weights [T, K] float32 and expert ids [T, K]."""

    def __init__(self, mla: DeepseekConfig, hidden: int):
        super().__init__()
        self.mla = mla
        experts = mla.n_routed_experts
        assert experts is not None              # a router only on MoE layers (`is_moe_layer`)
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32), requires_grad=False)
        if mla.sigmoid_routing:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32),
                                                        requires_grad=False)

    def _group_mask(self, choice: torch.Tensor, group_score: Callable[[torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor | None:
        """True for experts in the `topk_group` best groups (None when routing is not group-limited)."""
        mla = self.mla
        groups = mla.n_group or 1
        if groups == 1 or mla.topk_method == "greedy":
            return None
        assert mla.topk_group is not None       # `parse_deepseek` requires it with n_group > 1
        t = choice.shape[0]
        scores = group_score(choice.view(t, groups, -1))                     # [T, groups]
        best = torch.topk(scores, k=mla.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(scores).scatter_(1, best, 1).bool()
        return mask.unsqueeze(-1).expand(t, groups, choice.shape[1] // groups).reshape(t, -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mla = self.mla
        assert mla.num_experts_per_tok is not None      # `parse_deepseek` requires it with n_routed_experts
        logits = F.linear(x.float(), self.weight)
        if mla.sigmoid_routing:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            mask = self._group_mask(choice, lambda g: g.topk(2, dim=-1)[0].sum(dim=-1))
            if mask is not None:
                choice = choice.masked_fill(~mask, float("-inf"))
            ids = torch.topk(choice, k=mla.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        else:
            scores = logits.softmax(dim=-1)
            mask = self._group_mask(scores, lambda g: g.max(dim=-1).values)
            if mask is not None:
                scores = scores.masked_fill(~mask, 0.0)
            weights, ids = torch.topk(scores, k=mla.num_experts_per_tok, dim=-1, sorted=False)
        if mla.norm_topk_prob and mla.version == 3:      # transformers' V2 router never renormalises
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * mla.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts (`FusedExperts`) + the shared experts (one dense `MLP` of their summed width)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        mla, hidden = config.mla, config.hidden_size
        self.gate = Router(mla, hidden)
        self.experts = FusedExperts(mla.n_routed_experts, hidden, mla.moe_intermediate_size,
                                    act=act_and_mul(config.hidden_act))
        shared = (mla.n_shared_experts or 0) * mla.moe_intermediate_size
        self.shared_experts = MLP(config, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, ids, weights)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DeepseekForCausalLM(MixtralForCausalLM):
    # No fused q/k/v (MLA's projections load as they are named); the dense MLPs and shared experts pack gate/up.
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    moe_prefix = "mlp"
    names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    moe_class = MoE

    def rope_tables(self, config: ModelConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(config.mla, positions)      # [positions, qk_rope_head_dim / 2]

    def make_attention(self, config: ModelConfig, local: int, layer: int) -> nn.Module:
        return MLAttention(config, local)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return MoE(config) if config.mla.is_moe_layer(layer) else MLP(config)

    def num_experts(self) -> int:
        return self.config.mla.n_routed_experts

    def expected_weights(self) -> set[str]:
        """A V3 checkpoint may lack `e_score_correction_bias` (one saved with softmax routing, which
        transformers' V3 does not read): the router then corrects by zeros, as transformers does."""
        return {n for n in super().expected_weights() if not n.endswith("e_score_correction_bias")}

    def skips(self, name: str) -> bool:
        """Also fp8 scales: `fp8.dequantized` reads them with their weights before names are matched."""
        return super().skips(name) or (name.endswith("_scale_inv") and self.config.mla.fp8_block is not None)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]], threads: int = 0) -> set[str]:
        weights = self._without_mtp(weights)
        if self.config.mla.fp8_block is not None:
            weights = dequantized(weights, self.config.mla.fp8_block)
        return super().load_weights(weights, threads)

    def _without_mtp(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Every tensor but those of the multi-token-prediction layers (index >= num_hidden_layers)."""
        layers, skipped = self.config.num_hidden_layers, set()
        for name, source in weights:
            if name.endswith("_scale_inv") and self.config.mla.fp8_block is None:
                raise ValueError(f"tensor '{name}' scales fp8 weights, but config.json has no quantization_config")
            parts = name.split(".", 3)
            if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers:
                skipped.add(int(parts[2]))
                continue
            yield name, source
        if skipped:
            log.info("skipped multi-token-prediction layer(s) %s of the checkpoint: not used for decoding",
                     ", ".join(map(str, sorted(skipped))))
