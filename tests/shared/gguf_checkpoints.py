"""Tiny random Llama / Qwen2 models built with transformers and written as GGUF files with the `gguf` package's
own writer, as llama.cpp's converter writes them (Q/K rows permuted for llama; quantized with
`gguf.quants.quantize`): the files the GGUF tests load.

Weights are redrawn at scales where logits are O(1) (moe_checkpoints.py says why).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def hf_model(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers LlamaForCausalLM / Qwen2ForCausalLM with redrawn weights."""
    import transformers
    cfg_cls, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    model = cls(cfg_cls(**{**CONFIG, **overrides})).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                scale = 3.0 if "lm_head" in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_NAMES[module]}.{parts[-1]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for Q and K (its `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's row order of GGUF Q/K rows (`permute` undone)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: Any, path: Path, kind: str = "F32", arch: str = "llama",
               tokenizer: dict[str, Any] | None = None, kinds: dict[str, str] | None = None,
               raw: dict[str, tuple[str, np.ndarray]] | None = None) -> Path:
    """`model` as a GGUF file: projections and the LM head in `kind` (F32, F16, Q8_0, Q4_0; `kinds` by GGUF
    name overrides), norms and the embedding table F32 unless `kinds` says otherwise; `raw`: GGUF name →
    (type, block bytes in the file's row order) written as they are (types the package cannot quantize)."""
    import gguf
    from gguf.quants import quantize
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if tokenizer is not None:
        w.add_tokenizer_model(tokenizer.get("model", "gpt2"))
        w.add_tokenizer_pre(tokenizer.get("pre", "default"))
        w.add_token_list(tokenizer["tokens"])
        w.add_token_types(tokenizer["types"])
        if "merges" in tokenizer:
            w.add_token_merges(tokenizer["merges"])
        if "scores" in tokenizer:
            w.add_token_scores(tokenizer["scores"])
        w.add_bos_token_id(c.bos_token_id)
        w.add_eos_token_id(c.eos_token_id)
        w.add_add_bos_token(tokenizer.get("add_bos", True))
        if "chat_template" in tokenizer:
            w.add_chat_template(tokenizer["chat_template"])
    for name, p in model.state_dict().items():
        if "rotary_emb" in name or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        g = gguf_name(name)
        if raw and g in raw:
            qtype = gguf.GGMLQuantizationType[raw[g][0]]
            w.add_tensor(g, raw[g][1], raw_dtype=qtype)
            continue
        a = p.detach().float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            a = permute(a, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        t = (kinds or {}).get(g) or (kind if a.ndim == 2 and "embed" not in name else "F32")
        if t == "F32":
            w.add_tensor(g, np.ascontiguousarray(a))
        elif t == "F16":
            w.add_tensor(g, np.ascontiguousarray(a.astype(np.float16)))
        else:
            qtype = gguf.GGMLQuantizationType[t]
            w.add_tensor(g, quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
