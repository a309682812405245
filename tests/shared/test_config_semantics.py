"""Config fields read as transformers reads them, family by family: fields config.json lacks (the family's
defaults), which layers slide (and with which window when the key is absent), RoPE's original length and
theta, biases a family does not have, and DeepSeek's router. Each case edits a saved checkpoint's
config.json the way published checkpoints differ, reloads it in transformers, and compares logits
(prefill, then teacher-forced decode steps) within 1e-4."""

import json

import pytest
import torch

from tests.conftest import make_engine
from tests.helpers import random_hf_checkpoint, stepwise_logits
from tests.shared import moe_checkpoints
from tests.shared.deepseek_checkpoints import deepseek_checkpoint

transformers = pytest.importorskip("transformers")

DROP = object()
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
NO_ROPE_NO_EPS = {"rope_parameters": DROP, "rope_scaling": DROP, "rope_theta": DROP, "rms_norm_eps": DROP}

# name: (builder, arch or config name, build overrides, config.json edits, the layer kinds we must read)
CASES = {
    "llama-ignores-sliding-window": ("dense", "llama", {}, {"sliding_window": 8}, "FF"),
    "mistral-ignores-use-sliding-window": ("dense", "mistral", {"sliding_window": 8},
                                           {"use_sliding_window": False}, "SS"),
    "mistral-ignores-attention-bias": ("dense", "mistral", {"sliding_window": None}, {"attention_bias": True}, "FF"),
    "qwen2-window-needs-use-sliding-window": ("dense", "qwen2", {"sliding_window": 8},
                                              {"sliding_window": 8, "use_sliding_window": DROP,
                                               "max_window_layers": DROP, "layer_types": DROP}, "FF"),
    "qwen3-max-window-layers-defaults-to-28": ("dense", "qwen3", {"use_sliding_window": True, "sliding_window": 8},
                                               {"max_window_layers": DROP, "layer_types": DROP}, "FF"),
    "qwen3-moe-slides-every-layer": ("moe", "qwen3_moe", {"use_sliding_window": True, "sliding_window": 8,
                                                          "max_window_layers": 1}, {}, "SSS"),
    "gpt-oss-alternates-without-layer-types": ("moe", "gpt_oss", {}, {"layer_types": DROP}, "SFSF"),
    "llama3-rope-original-defaults-to-max-positions": ("dense", "llama", {"rope_theta": 500000.0,
                                                                          "rope_scaling": {**LLAMA3}},
                                                       {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}},
                                                       "FF"),
    "llama3-rope-top-level-original-wins": ("dense", "llama", {"rope_theta": 500000.0, "rope_scaling": {
        **LLAMA3, "original_max_position_embeddings": 64}}, {"original_max_position_embeddings": 128}, "FF"),
    # a RoPE dict's theta wins over a top-level one; a field config.json lacks takes the family's default
    "rope-dict-theta-wins-over-top-level": ("dense", "llama", {}, {"rope_theta": 10.0}, "FF"),
    "mixtral-absent-fields-take-its-defaults": ("moe", "mixtral-sliding", {}, NO_ROPE_NO_EPS, "SSS"),
    "gpt-oss-absent-fields-take-its-defaults": ("moe", "gpt_oss", {"attention_bias": True},
                                                {**NO_ROPE_NO_EPS, "attention_bias": DROP}, "SFSF"),
    "llama4-absent-fields-take-its-defaults": ("moe", "llama4", {}, NO_ROPE_NO_EPS, "CFCF"),
    # tie_word_embeddings over a checkpoint with a head of its own: transformers keeps that head
    "tied-config-over-a-distinct-head-stays-untied": ("dense", "llama", {"tie_word_embeddings": False},
                                                      {"tie_word_embeddings": True}, "FF"),
}


def _edit(path, edits: dict) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in edits.items():
        if value is DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))


def _compare(path, ids: list[int], prefill: int, hf=None) -> float:
    """Engine against transformers (`hf`, else the checkpoint reloaded as edited)."""
    if hf is None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    engine = make_engine(path, block_size=4, num_blocks=64)
    ours = stepwise_logits(engine, ids, prefill)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, prefill - 1:]
    return engine, (ours - ref).abs().max().item()


@pytest.mark.parametrize("name", CASES)
def test_config_read_as_transformers_reads_it(tmp_path, name):
    builder, arch, overrides, edits, kinds = CASES[name]
    if builder == "dense":
        path, _ = random_hf_checkpoint(tmp_path, arch, **overrides)
    else:
        path, _ = moe_checkpoints.build(tmp_path, arch, **overrides)
    _edit(path, edits)
    ids = torch.randint(2, 257, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    engine, err = _compare(path, ids, prefill=30)
    assert "".join({"sliding": "S", "chunked": "C"}.get(a.kind, "F") for a in engine.config.layer_attention) == kinds
    assert err <= 1e-4
    hf_config = transformers.AutoConfig.from_pretrained(path)
    assert engine.config.rms_norm_eps == getattr(hf_config, "text_config", hf_config).rms_norm_eps


@pytest.mark.parametrize("name, version, overrides", [
    ("v3-one-expert-renormalised", "v3-qlora-yarn-grouped", {"num_experts_per_tok": 1, "norm_topk_prob": True}),
    ("v2-never-renormalises", "v2-no-qlora-grouped", {"norm_topk_prob": True}),
    ("v3-ignores-softmax-scoring", "v3-qlora-yarn-grouped", {"scoring_func": "softmax", "topk_method": "greedy"}),
    ("v3-ignores-moe-layer-freq", "v3-qlora-yarn-grouped", {"moe_layer_freq": 2, "first_k_dense_replace": 0}),
])
def test_deepseek_routing_read_as_transformers_reads_it(tmp_path, name, version, overrides):
    path, hf = deepseek_checkpoint(tmp_path, version, **overrides)
    ids = torch.randint(2, 257, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    assert _compare(path, ids, prefill=30, hf=hf)[1] <= 1e-4


def test_deepseek_v2_mlp_bias(tmp_path):
    path, hf = deepseek_checkpoint(tmp_path, "v2-no-qlora-grouped", mlp_bias=True)
    with torch.no_grad():          # transformers zero-initialises biases: give them values that matter
        for pname, p in hf.named_parameters():
            if pname.endswith("bias") and "mlp" in pname:
                p.normal_(0, 0.5)
    hf.save_pretrained(path, safe_serialization=True)
    ids = torch.randint(2, 257, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    assert _compare(path, ids, prefill=30, hf=hf)[1] <= 1e-4


def test_deepseek_v3_without_correction_bias_routes_with_zeros(tmp_path):
    """A V3 checkpoint saved with softmax routing has no e_score_correction_bias; transformers' V3 still
    routes by sigmoid, correcting by zeros."""
    from safetensors.torch import load_file, save_file
    path, _ = deepseek_checkpoint(tmp_path, "v3-qlora-yarn-grouped")
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if "e_score_correction_bias" not in k}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    _edit(path, {"scoring_func": "softmax", "topk_method": "greedy"})
    ids = torch.randint(2, 257, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    assert _compare(path, ids, prefill=30)[1] <= 1e-4


def test_deepseek_v3_absent_routing_keys_take_transformers_defaults(tmp_path):
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.errors import ConfigError
    path, _ = deepseek_checkpoint(tmp_path, "v3-qlora-yarn-grouped")
    raw = json.loads((path / "config.json").read_text())
    for key in ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace"):
        raw.pop(key, None)
    mla = ModelConfig.from_dict(raw).mla
    assert (mla.n_group, mla.topk_group, mla.norm_topk_prob, mla.routed_scaling_factor,
            mla.first_k_dense_replace) == (8, 4, True, 2.5, 3)
    with pytest.raises(ConfigError, match="topk_group"):     # explicit null: transformers' router would fail
        ModelConfig.from_dict({**raw, "n_group": 4, "topk_group": None})


def test_tied_config_over_a_copy_of_the_embeddings_stays_tied(tmp_path):
    """A checkpoint that stores the tied head as a copy of the embedding table: one tensor, shared."""
    from safetensors.torch import load_file, save_file
    path, _ = random_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = make_engine(path, block_size=4, num_blocks=16).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
