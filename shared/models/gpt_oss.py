"""gpt-oss: attention with learned sinks (alternating sliding-window / full layers, YaRN RoPE, biases
everywhere) and an MoE of clamped-SwiGLU experts with router and expert biases.

Life cycle: as `LlamaForCausalLM`. Checkpoints store all experts of a layer as stacked tensors:
`mlp.experts.gate_up_proj` [E, H, 2I] (gate and up interleaved along the last dimension),
`down_proj` [E, I, H], and their biases; published checkpoints store the two weight tensors as
MXFP4 instead (`*_blocks` [E, rows, cols/32, 16] uint8: two 4-bit e2m1 codes per byte, low nibble
first; `*_scales` [E, rows, cols/32] uint8: a power-of-two exponent + 127 per 32 values).
We dequantize MXFP4 at load into the model's dtype (bf16 on accelerators, fp32 on CPU): simple,
exact against transformers' dequantized model, at the price of 4x the expert memory of an MXFP4
kernel. Each rank keeps its shard of the intermediate dimension.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.llama import Attention, LlamaForCausalLM
from edgecore.shared.models.moe import Activation, FusedExperts, topk_softmax
from edgecore.shared.models.row_buckets import bounded_linear
from edgecore.shared.models.parallel import tensor_parallel

if TYPE_CHECKING:
    from edgecore.shared.models.layers import WeightSource

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 → [..., G * 32] values (the matrix as stored: rows
    are output features, columns input features)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=torch.float32)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None].float())
    return out.flatten(-2).to(dtype)


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return act


class SinkAttention(Attention):
    """Attention whose heads each have a learned sink logit (this rank's heads only)."""

    def __init__(self, config: ModelConfig, layer: int, global_layer: int):
        super().__init__(config, layer, global_layer)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        start = tensor_parallel().rank * self.num_heads
        value = source[start:start + self.num_heads] if not isinstance(source, torch.Tensor) else \
            source[start:start + self.num_heads]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"expected {self.num_heads * tensor_parallel().size} sinks, got {tuple(value.shape)}")
        param.data.copy_(value)


class GptOssMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        p = config.params
        self.router = nn.Linear(config.hidden_size, p.num_local_experts, bias=True)
        self.experts = FusedExperts(p.num_local_experts, config.hidden_size, config.intermediate_size, bias=True,
                                    act=clamped_swiglu(p.swiglu_alpha, p.swiglu_limit))
        self.top_k = p.num_experts_per_tok
        self.pending: dict[str, torch.Tensor] = {}      # MXFP4 blocks waiting for their scales (or back)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(bounded_linear(x, self.router.weight, self.router.bias), self.top_k)
        return self.experts(x, ids, weights)

    def load(self, tensor: str, kind: str, value: torch.Tensor) -> None:
        """One stacked checkpoint tensor: `tensor` gate_up_proj / down_proj, `kind` '', _bias, _blocks, _scales."""
        if kind in ("_blocks", "_scales"):
            self.pending[tensor + kind] = value
            if tensor + "_blocks" not in self.pending or tensor + "_scales" not in self.pending:
                return
            value = dequantize_mxfp4(self.pending.pop(tensor + "_blocks"), self.pending.pop(tensor + "_scales"),
                                     self.experts.w13.dtype).transpose(1, 2)     # as the bf16 layout
            kind = ""
        e = self.experts
        if tensor == "gate_up_proj" and kind == "":            # [E, H, 2I], gate/up interleaved
            for i in range(e.num_experts):
                e.load_expert("gate", i, value[i, :, 0::2].t())
                e.load_expert("up", i, value[i, :, 1::2].t())
        elif tensor == "gate_up_proj":                          # bias [E, 2I]
            for i in range(e.num_experts):
                e.load_expert("gate_bias", i, value[i, 0::2])
                e.load_expert("up_bias", i, value[i, 1::2])
        elif kind == "":                                        # down [E, I, H]
            for i in range(e.num_experts):
                e.load_expert("down", i, value[i].t())
        else:
            for i in range(e.num_experts):
                e.load_expert("down_bias", i, value[i])


class GptOssForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig, local: int, layer: int) -> nn.Module:
        return SinkAttention(config, local, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return GptOssMoE(config)

    def load_special(self, name: str, local_name: str, source: WeightSource) -> bool:
        m = STACKED.match(local_name)
        if m is None:
            return False
        value = source if isinstance(source, torch.Tensor) else source[:]
        try:
            cast(GptOssMoE, self.get_submodule(m.group(1)[:-len(".experts")])).load(m.group(2), m.group(3) or "", value)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise ValueError(f"tensor '{name}': {exc}") from None
        return True

    def special_names(self, param_name: str) -> list[str] | None:
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(w13|w2|b13|b2)$", param_name)
        if m is None:
            return None
        tensor = "gate_up_proj" if m.group(2) in ("w13", "b13") else "down_proj"
        if m.group(2).startswith("b"):
            return [f"{m.group(1)}.{tensor}_bias"]
        if self.config.params.quantization_config is not None:
            return [f"{m.group(1)}.{tensor}_blocks", f"{m.group(1)}.{tensor}_scales"]
        return [f"{m.group(1)}.{tensor}"]
