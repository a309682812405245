"""DeepSeek-V2/V3 decoder (and Kimi K2, which declares DeepseekV3ForCausalLM): multi-head latent attention
(`mla.py`) and a routed mixture of experts with shared experts, over a paged cache of latent vectors.

Life cycle: as for the Llama family (`llama.py`, whose forward, logits and checkpoint loading this class
reuses): `DeepseekForCausalLM(config)` allocates this rank's shards, `load_weights` fills them from the
Hugging Face checkpoint (routed experts one matrix at a time into `FusedExperts`), then each step runs
`forward(input_ids [T], positions [T], meta)` and `compute_logits`.

Layers: the first `first_k_dense_replace` layers (and those off `moe_layer_freq`) have a dense MLP,
the others a MoE: the router scores experts (V3: sigmoid, plus `e_score_correction_bias` for the choice
only; V2: softmax), limits the choice to the `topk_group` best of `n_group` expert groups, takes the top
`num_experts_per_tok`, optionally renormalises (`norm_topk_prob`) and scales by `routed_scaling_factor`;
the shared experts run on every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgecore.shared.config import ModelConfig
from edgecore.shared.models.layers import (MergedColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                           VocabParallelEmbedding)
from edgecore.shared.models.llama import LlamaForCausalLM, RMSNorm
from edgecore.shared.models.mla import MLAttention, rope_cos_sin
from edgecore.shared.models.mla_config import DeepseekConfig
from edgecore.shared.models.moe import FusedExperts


class GatedMLP(nn.Module):
    """silu(x W_gate) * (x W_up) W_down: the dense layers' MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Expert choice of every token: weights [T, K] float32 and expert ids [T, K]."""

    def __init__(self, mla: DeepseekConfig, hidden: int):
        super().__init__()
        self.mla = mla
        experts = mla.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32), requires_grad=False)
        if mla.sigmoid_routing:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32),
                                                        requires_grad=False)

    def _group_mask(self, choice: torch.Tensor, group_score) -> torch.Tensor | None:
        """True for experts in the `topk_group` best groups (None when routing is not group-limited)."""
        mla = self.mla
        groups = mla.n_group or 1
        if groups == 1 or mla.topk_method == "greedy":
            return None
        t = choice.shape[0]
        scores = group_score(choice.view(t, groups, -1))                     # [T, groups]
        best = torch.topk(scores, k=mla.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(scores).scatter_(1, best, 1).bool()
        return mask.unsqueeze(-1).expand(t, groups, choice.shape[1] // groups).reshape(t, -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mla = self.mla
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
        if mla.norm_topk_prob and mla.num_experts_per_tok > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * mla.routed_scaling_factor, ids


class MoE(nn.Module):
    def __init__(self, mla: DeepseekConfig, hidden: int):
        super().__init__()
        self.gate = Router(mla, hidden)
        self.experts = FusedExperts(mla.n_routed_experts, hidden, mla.moe_intermediate_size)
        shared = (mla.n_shared_experts or 0) * mla.moe_intermediate_size
        self.shared_experts = GatedMLP(hidden, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, ids, weights)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, local: int):
        super().__init__()
        self.self_attn = MLAttention(config, local)
        moe = config.mla.is_moe_layer(layer)
        self.mlp = MoE(config.mla, config.hidden_size) if moe else GatedMLP(config.hidden_size,
                                                                            config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: range | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layer_ids = list(layers if layers is not None else range(config.num_hidden_layers))
        self.layers = nn.ModuleList(DecoderLayer(config, gid, local) for local, gid in enumerate(self.layer_ids))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


EXPERT_MATRICES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class DeepseekForCausalLM(LlamaForCausalLM):
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, layers: range | None = None):
        nn.Module.__init__(self)          # the Llama layers are not built; forward and loading are shared
        self.config = config
        self.model = DeepseekModel(config, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_cos_sin(config.mla, config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _moe_layers(self) -> list[tuple[int, MoE]]:
        return [(gid, layer.mlp) for gid, layer in zip(self.model.layer_ids, self.model.layers)
                if isinstance(layer.mlp, MoE)]

    def expected_weights(self) -> set[str]:
        names = {n for n in super().expected_weights() if not n.endswith((".experts.w13", ".experts.w2"))}
        for gid, moe in self._moe_layers():
            for e in range(moe.experts.num_experts):
                names.update(f"model.layers.{gid}.mlp.experts.{e}.{m}.weight" for m in EXPERT_MATRICES)
        return names

    def _load_weights(self, weights, pool, jobs) -> set[str]:
        """Routed experts go into their layer's `FusedExperts` here; everything else as for Llama."""
        moe = dict(self._moe_layers())
        used: set[str] = set()

        def others():
            for name, source in weights:
                parts = name.split(".")
                if len(parts) == 8 and parts[3:5] == ["mlp", "experts"] and parts[6] in EXPERT_MATRICES:
                    layer = moe.get(int(parts[2]))
                    if layer is not None:
                        try:
                            layer.experts.load_expert(EXPERT_MATRICES[parts[6]], int(parts[5]), source)
                        except (RuntimeError, IndexError) as exc:
                            raise ValueError(f"tensor '{name}': {exc}") from None
                        used.add(name)
                    continue
                yield name, source

        return super()._load_weights(others(), pool, jobs) | used
