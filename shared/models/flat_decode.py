"""`FlatDecoder`: a pure decode step of a plain Llama-family model with its module tree flattened.

Life cycle: `ModelRunner` asks `FlatDecoder.for_model(model)` once, after the weights are packed and
their layouts' crossover timed (`layers.calibrate_plain_rows`; weights are final from then on). It returns
None unless every layer is the base `Attention` + `MLP` of llama.py, on one rank, with every projection
holding both the oneDNN-packed weight and the input-major copy that few-row matmuls read (small float32
weights), switching between them at one row count. Otherwise each step with no prefill chunk (a pure
decode step: batch-1 serving is one, and every step of a steady batch), and each step of at most
`SMALL_STEP` tokens with chunks (a decode with speculative drafts, a short prompt), runs `forward` instead of
the model's, with the same operators in the same order (the layout `_Matmul.matmul` picks for that many rows,
`paged_attention`, RMSNorm's float32 form, RoPE, the activation), so the hidden states are the model's bit
for bit (tests/shared/test_flat_decode.py).

Why: at one row the arithmetic of a small model is less than the interpreter's work around it. A
step through the module tree (attribute lookups of submodules and parameters, each projection's
choice of layout, optional norms and biases checked per call) cost the bundled model 1.56–1.64× a
hand-written eager step over the same weights (`bench/decode.py --floor`); here every per-layer
tensor and flag is looked up once, at build time, into a tuple, and the layout once per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from edgecore.shared.models.attention import AttentionMetadata, paged_attention
from edgecore.shared.models.row_buckets import packed_linear
from edgecore.shared.models.rope import apply_rope
from edgecore.shared.models.parallel import tensor_parallel

SMALL_STEP = 64         # tokens: steps with prefill chunks up to this size run here too

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torch import nn

    from edgecore.shared.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.RMSNorm's float32 arithmetic, op for op (the compiled step's too)."""
    return (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)


def _column(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A column-parallel projection on one rank, input-major: the bias inside the matmul, as `_Matmul.matmul`."""
    return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)


def _row(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel projection on one rank: the bias after the (here trivial) reduce, as RowParallelLinear."""
    y = torch.mm(x, wt)
    return y if bias is None else y + bias


def _row_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`_row` through the oneDNN-packed weight; a column projection packed is `packed_linear` itself."""
    y = packed_linear(x, packed, None)
    return y if bias is None else y + bias


class FlatDecoder:
    def __init__(self, model: LlamaForCausalLM, plain_below: int):
        self.model = model
        self.plain_below = plain_below      # rows from which the projections read their packed weights
        self.embed = model.model.embed_tokens.weight
        self.few: list[tuple] = []          # per layer, projections input-major (`_Matmul.transposed`)
        self.many: list[tuple] = []         # per layer, projections packed (`_Matmul.packed`)
        for layer in cast("Iterable[DecoderLayer]", model.model.layers):       # as `for_model` checked
            attn, mlp = cast("Attention", layer.self_attn), cast("MLP", layer.mlp)
            norms = hasattr(attn, "q_norm")
            q_norm = (attn.q_norm.weight, attn.q_norm.eps) if norms else None
            k_norm = (attn.k_norm.weight, attn.k_norm.eps) if norms else None
            for out, weight in ((self.few, "transposed"), (self.many, "packed")):
                out.append((
                    layer.input_layernorm.weight, layer.input_layernorm.eps,
                    getattr(attn.qkv_proj, weight), attn.qkv_proj.bias, attn.num_heads, attn.num_kv_heads,
                    attn.head_dim, q_norm, k_norm, attn.layer, attn.scale, attn.form, attn.sinks,
                    getattr(attn.o_proj, weight), attn.o_proj.bias,
                    layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                    getattr(mlp.gate_up_proj, weight), mlp.gate_up_proj.bias, mlp.act,
                    getattr(mlp.down_proj, weight), mlp.down_proj.bias))

    @classmethod
    def for_model(cls, model: nn.Module) -> FlatDecoder | None:
        from edgecore.shared.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
        if not isinstance(model, LlamaForCausalLM) or tensor_parallel().size != 1:
            return None
        if type(model).forward is not LlamaForCausalLM.forward or \
                len(model.model.layer_ids) != model.config.num_hidden_layers:
            return None             # a family with its own step, or a pipeline stage
        if getattr(model.model.embed_tokens, "quant_rows", None) is not None:
            return None             # an embedding kept in GGUF blocks: its rows are decoded per lookup
        thresholds = set()
        for layer in model.model.layers:
            if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or \
                    type(layer.mlp) is not MLP:
                return None
            projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj)
            if any(p.transposed is None or p.packed is None for p in projections):
                return None         # not float32 with small weights: the packed or plain layout alone is used
            thresholds |= {p.plain_below for p in projections}
            if layer.input_layernorm.weight.dtype != torch.float32:
                return None
        if len(thresholds) != 1:
            return None             # projections that switch layout at different row counts: the model's path
        return cls(model, thresholds.pop())

    def takes(self, meta: AttentionMetadata, rows: int) -> bool:
        """A pure decode step, or a small step with chunks (speculative drafts, short prompts): at most
        `SMALL_STEP` tokens, where the interpreter's work around the module tree still shows."""
        return (not meta.prefills and meta.num_decode == rows) or rows <= SMALL_STEP

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = input_ids.shape[0]
        x = torch.nn.functional.embedding(input_ids, self.embed)
        cos, sin = self.model.rope_inputs(positions, x.dtype)
        few = t < self.plain_below
        column, row = (_column, _row) if few else (packed_linear, _row_packed)
        for (n1, e1, qkv_t, qkv_b, heads, kvh, d, q_norm, k_norm, index, scale, form, sinks, o_t, o_b,
             n2, e2, gu_t, gu_b, act, down_t, down_b) in (self.few if few else self.many):
            qkv = column(rms_norm(x, n1, e1), qkv_t, qkv_b).view(t, heads + 2 * kvh, d)
            if q_norm is None:
                qk = qkv[:, :heads + kvh]
            else:
                qk = torch.cat([rms_norm(qkv[:, :heads], *q_norm), rms_norm(qkv[:, heads:heads + kvh], *k_norm)], 1)
            qk = apply_rope(qk, cos, sin)
            o = paged_attention(qk[:, :heads], qk[:, heads:], qkv[:, heads + kvh:], index, meta, scale, form, sinks)
            x = x + row(o.reshape(t, heads * d), o_t, o_b)
            gate, up = column(rms_norm(x, n2, e2), gu_t, gu_b).chunk(2, dim=-1)
            x = x + row(act(gate) * up, down_t, down_b)
        return x
