"""Tiny random-weight checkpoints of the MoE / new-attention families, built with transformers' own
config classes and saved with `save_pretrained`, plus transformers' greedy reference.

Weights are redrawn at scales where activations and logits are O(1) (transformers' initializer
gives near-uniform logits, where greedy choices would tie); `reference` reports the smallest
top-1/top-2 logit margin over the run so tests can check that choices are well separated.
"""

from __future__ import annotations

import json
import math

import torch

from tests.helpers import HF_CLASSES

BASE = dict(vocab_size=257, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)

ARCHS = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_moe-step2": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=4)),
    "mixtral-sliding": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, num_hidden_layers=4,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False})),
    "llama4": ("llama4", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96,
                              attention_chunk_size=8, interleave_moe_layer_step=2, num_hidden_layers=4,
                              no_rope_layer_interval=2, floor_scale=4, attn_scale=0.5)),
}


def _redraw(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:   # 2-D [out, in] (nn.Linear) or stacked experts [E, in, out] / [E, in, 2*out]
                fan_in = p.shape[-1] if p.dim() == 2 else p.shape[1]
                scale = 3.0 if "lm_head" in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) / math.sqrt(fan_in))


def build(tmp_path, name: str, **overrides):
    """Save checkpoint `name` (a key of ARCHS) under tmp_path; returns (dir, transformers model)."""
    import transformers
    arch, extra = ARCHS[name]
    cfg_cls, cls = (getattr(transformers, n) for n in HF_CLASSES[arch])
    torch.manual_seed(0)
    model = cls(cfg_cls(**{**BASE, **extra, **overrides})).eval()
    _redraw(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


@torch.no_grad()
def reference(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor, float]:
    """transformers' greedy continuation (full forward each step, no cache), the logits of every position
    from the last prompt token on, and the smallest top-1/top-2 margin among the greedy choices."""
    ids = list(prompt)
    for _ in range(steps):
        logits = hf(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    logits = hf(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    return ids[len(prompt):], logits, float((top2[:, 0] - top2[:, 1]).min())


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., cols] float → (blocks [..., cols/32, 16] uint8, scales [..., cols/32] uint8): per 32 values a
    power-of-two scale that brings the largest to ≤ 6, each value rounded to the nearest e2m1 code, two
    codes per byte, low nibble first (the published gpt-oss layout)."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    peak = groups.abs().amax(-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    codes = (groups / torch.exp2(exp)[..., None])[..., None].sub(values).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def to_mxfp4_checkpoint(path, hf) -> None:
    """Rewrite a saved gpt-oss checkpoint with MXFP4 expert weights, and set `hf`'s expert weights to the
    values transformers' own dequantizer gives for them (the reference)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    tensors = load_file(str(path / "model.safetensors"))
    params = dict(hf.named_parameters())
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = tensors.pop(name).transpose(1, 2).contiguous()      # [E, out, in], as published
        blocks, scales = quantize_mxfp4(stored)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        with torch.no_grad():
            params[name].copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
