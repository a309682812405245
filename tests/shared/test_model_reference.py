"""Logits equal transformers' (fp32, ≤ 1e-4) for prefill and every decode step."""

import pytest
import torch

from tests.conftest import make_engine
from tests.helpers import random_hf_checkpoint, stepwise_logits

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama-mha-head-dim": ("llama", {"num_key_value_heads": 4, "head_dim": 24}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                    "rope_theta": 5000.0}),
    "llama-rope-llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64},
                                    "rope_theta": 500000.0}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-every-option": ("llama", {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu_pytorch_tanh",
                                     "head_dim": 24, "tie_word_embeddings": True, "num_key_value_heads": 1,
                                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     "rope_theta": 500000.0}),
    "llama-rope-dynamic-gelu": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                                          "hidden_act": "gelu"}),
    "qwen2-gelu-new": ("qwen2", {"hidden_act": "gelu_new"}),
    "mistral-relu": ("mistral", {"hidden_act": "relu", "sliding_window": 8}),
    "qwen3-quick-gelu": ("qwen3", {"hidden_act": "quick_gelu"}),
    "qwen3-swish-fast": ("qwen3", {"hidden_act": "gelu_fast"}),
    "qwen2-bias-gqa": ("qwen2", {"num_key_value_heads": 2}),
    "qwen2-mqa-tied": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-sliding-8": ("mistral", {"sliding_window": 8}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 24}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 64}}),
}


def compare(engine, hf, ids, prefill_len):
    ours = stepwise_logits(engine, ids, prefill_len)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, prefill_len - 1:]
    return (ours - ref).abs().max().item()


def test_qwen2_sliding_layers_from_max_window_layers_without_layer_types(tmp_path):
    """Checkpoints saved before `layer_types` existed name the sliding layers by `max_window_layers`."""
    import json
    path, hf = random_hf_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("layer_types") == ["full_attention", "sliding_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    engine = make_engine(path, block_size=4, num_blocks=64)
    assert [a.kind for a in engine.config.layer_attention] == ["full", "sliding"]
    ids = torch.randint(2, 257, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert compare(engine, hf, ids, prefill_len=30) <= 1e-4


@pytest.mark.parametrize("name", CONFIGS)
def test_random_config_logits_match(tmp_path, name):
    arch, overrides = CONFIGS[name]
    path, hf = random_hf_checkpoint(tmp_path, arch, **overrides)
    engine = make_engine(path, block_size=4, num_blocks=64)
    ids = torch.randint(2, 257, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert compare(engine, hf, ids, prefill_len=30) <= 1e-4


def test_bundled_model_logits_match(hf_model, model_dir, heldout, tokenizer):
    engine = make_engine(model_dir)
    ids = tokenizer.encode(heldout[:3000])[:300]
    assert compare(engine, hf_model, ids, prefill_len=260) <= 1e-4


def test_chunked_prefill_with_cached_context_matches(hf_model, model_dir, tokenizer, heldout):
    """A prefill that attends to context computed in an earlier chunk (prefix-hit path)."""
    engine = make_engine(model_dir, block_size=8)
    ids = tokenizer.encode(heldout[5000:8000])[:120]
    from edgecore.shared.engine.sampling_params import SamplingParams
    from edgecore.shared.engine.sequence import Sequence
    seq = Sequence("c", ids, SamplingParams())
    engine.block_manager.allocate_prompt(seq.table, ids, len(ids))
    with torch.inference_mode():
        outs = []
        for n in (50, 70):
            _, t, p, meta = engine.runner.prepare([(seq, n)])
            outs.append(engine.model.compute_logits(engine.model(t, p, meta)))
            seq.num_computed_tokens += n
        ours = torch.cat(outs)
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4
