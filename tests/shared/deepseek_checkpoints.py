"""Tiny random DeepSeek-V2/V3 checkpoints built with transformers' config classes (for the MLA tests)."""

from __future__ import annotations

import json

import torch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.707,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}

BASE = dict(vocab_size=257, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=1)

CONFIGS = {
    # name: (version, overrides)
    "v3-qlora-yarn-grouped": (3, dict(n_group=4, topk_group=2, rope_parameters=YARN)),
    "v3-no-qlora-halves": (3, dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "v2-greedy-yarn": (2, dict(topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.5,
                               n_shared_experts=2, rope_parameters=YARN)),
    "v2-no-qlora-grouped": (2, dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                    norm_topk_prob=False, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0})),
}


def deepseek_checkpoint(path, name: str, model_type: str | None = None, **extra):
    """Save a random DeepSeek checkpoint of config `name` under `path`; returns (path, the transformers model).
    Weights are scaled so that greedy choices and expert choices are well separated."""
    import transformers
    version, overrides = CONFIGS[name]
    cfg_cls, cls = ((transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM) if version == 3 else
                    (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM))
    cfg = cfg_cls(**{**BASE, **overrides, **extra})
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
            elif pname.endswith("gate.weight"):
                p.normal_(0, 0.5)                         # expert scores far apart
            elif p.dim() >= 2:
                p.normal_(0, 1.2 / p.shape[-1] ** 0.5)    # activations of order one: clear logit margins
        for name_, buf in model.named_buffers():
            if name_.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    if model_type is not None:                  # e.g. Kimi K2: DeepseekV3ForCausalLM under its own model_type
        cfg_path = path / "config.json"
        raw = json.loads(cfg_path.read_text())
        raw["model_type"] = model_type
        cfg_path.write_text(json.dumps(raw))
    return path, model
