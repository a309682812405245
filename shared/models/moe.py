"""Mixture-of-experts layers shared by every MoE architecture (Qwen3-MoE, Mixtral, gpt-oss, Llama 4,
DeepSeek): routed experts computed per expert over the tokens routed to it, never token by token.

Life cycle: an architecture builds `FusedExperts(num_experts, hidden, intermediate, ...)`, fills its
stacked weights from the checkpoint through `load_expert(name, expert, source)` (one expert's
gate / up / down matrix at a time, only this rank's shard of the intermediate dimension) or
`load_stacked(name, source)` (checkpoints that store all experts in one tensor), and calls
`forward(x, topk_ids, topk_weights)` with the routing its router chose. Routing itself (softmax or
sigmoid scores, top-k, grouped top-k, renormalisation, scaling) belongs to the architecture; helpers
for the common forms are here.

Compute: the (token, slot) pairs are sorted by expert id; each expert that got tokens runs one
gate_up matmul, the activation and one down matmul over its contiguous slice; the results are
weighted, put back in (token, slot) order with one scatter and summed over the slots.

Tensor parallel: every rank holds every expert, sharded along the intermediate dimension (a column
split of gate/up, a row split of down), so one all-reduce per MoE layer, as a dense MLP. Expert
parallelism would need all-to-all exchanges of tokens, which gloo on CPU makes slower than the
matmuls it saves at the sizes an edge runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from edgecore.shared.models.activation import ACTIVATIONS
from edgecore.shared.models.row_buckets import bounded_linear
from edgecore.shared.models.parallel import all_reduce, tensor_parallel

if TYPE_CHECKING:
    from edgecore.shared.models.layers import WeightSource

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]      # (gate, up) -> hidden


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def act_and_mul(hidden_act: str) -> Activation:
    """The experts' (gate, up) -> act(gate) * up for a config's `hidden_act`."""
    if hidden_act in ("silu", "swish"):
        return silu_and_mul
    act = ACTIVATIONS[hidden_act]
    return lambda gate, up: act(gate) * up


def _read(source: WeightSource) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]


class FusedExperts(nn.Module):
    """`num_experts` gated MLPs stored as stacked tensors: w13 [E, 2*I_shard, H], w2 [E, H, I_shard]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool = False,
                 act: Activation = silu_and_mul, reduce: bool = True):
        super().__init__()
        tp = tensor_parallel()
        if intermediate % tp.size:
            raise ValueError(f"moe intermediate size {intermediate} does not split over {tp.size} ranks")
        self.num_experts, self.hidden, self.act, self.reduce = num_experts, hidden, act, reduce
        self.shard = intermediate // tp.size
        self.shard_start = tp.rank * self.shard
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.shard, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.shard), requires_grad=False)
        self.b13 = nn.Parameter(torch.zeros(num_experts, 2 * self.shard), requires_grad=False) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False) if bias else None

    # ---- loading -------------------------------------------------------------------------
    def _rows(self, source: WeightSource, dim: int) -> torch.Tensor:
        """This rank's slice of the intermediate dimension of one checkpoint tensor."""
        sl = [slice(None)] * len(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
        sl[dim] = slice(self.shard_start, self.shard_start + self.shard)
        return source[tuple(sl)]

    def load_expert(self, name: str, expert: int, source: WeightSource) -> None:
        """One expert's `gate`, `up` or `down` weight ([I, H], [I, H], [H, I]) or bias ([I], [I], [H])."""
        with torch.no_grad():
            if name in ("gate", "up"):
                half = slice(0, self.shard) if name == "gate" else slice(self.shard, 2 * self.shard)
                self.w13[expert, half].copy_(self._rows(source, 0))
            elif name == "down":
                self.w2[expert].copy_(self._rows(source, 1))
            elif name in ("gate_bias", "up_bias"):
                assert self.b13 is not None     # bias tensors come only for experts built with biases
                half = slice(0, self.shard) if name == "gate_bias" else slice(self.shard, 2 * self.shard)
                self.b13[expert, half].copy_(self._rows(source, 0))
            elif name == "down_bias":
                assert self.b2 is not None      # bias tensors come only for experts built with biases
                self.b2[expert].copy_(_read(source))
            else:
                raise KeyError(name)

    def set_stacked(self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> None:
        """All experts at once from full (unsharded) tensors laid out as [E, 2I (gate then up), H],
        [E, H, I], [E, 2I], [E, H]; this rank keeps its shard."""
        with torch.no_grad():
            inter = w2.shape[-1]
            s, e = self.shard_start, self.shard_start + self.shard
            self.w13[:, :self.shard].copy_(w13[:, s:e])
            self.w13[:, self.shard:].copy_(w13[:, inter + s:inter + e])
            self.w2.copy_(w2[:, :, s:e])
            if b13 is not None:
                assert self.b13 is not None     # bias tensors come only for experts built with biases
                self.b13[:, :self.shard].copy_(b13[:, s:e])
                self.b13[:, self.shard:].copy_(b13[:, inter + s:inter + e])
            if b2 is not None:
                assert self.b2 is not None      # bias tensors come only for experts built with biases
                self.b2.copy_(b2)

    # ---- compute -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                weight_inputs: bool = False) -> torch.Tensor:
        """x [T, H]; topk_ids, topk_weights [T, K] -> [T, H] (all-reduced across TP ranks). The routing weight
        scales each expert's output, or its input with `weight_inputs` (Llama 4)."""
        tokens, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)                      # (token, slot) pairs by expert
        token_of = order // k
        weight_of = topk_weights.reshape(-1)[order].to(x.dtype)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        ys = x.new_zeros(tokens * k, self.hidden)                     # expert outputs, in sorted order
        start = 0
        down_bias = self.b2 if self.b2 is not None and tensor_parallel().rank == 0 else None   # added once
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            idx = token_of[start:start + n]
            w = weight_of[start:start + n, None]
            h = bounded_linear(x[idx] * w if weight_inputs else x[idx], self.w13[expert],
                               None if self.b13 is None else self.b13[expert])
            h = self.act(h[:, :self.shard], h[:, self.shard:])
            y = bounded_linear(h, self.w2[expert], None if down_bias is None else down_bias[expert])
            ys[start:start + n] = y if weight_inputs else y * w
            start += n
        # Back to (token, slot) order with one scatter, then a sum over the k slots: no per-expert
        # index_add_ (slow on CPU), and a fixed summation order.
        out = torch.empty_like(ys)
        out[order] = ys
        out = out.view(tokens, k, self.hidden).sum(1)
        return all_reduce(out) if self.reduce else out


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then top-k (Qwen-MoE, Mixtral): weights [T, K] float32, ids [T, K]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the raw logits, then softmax over the chosen k (gpt-oss)."""
    values, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=torch.float32), ids
