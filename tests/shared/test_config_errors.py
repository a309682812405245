"""Unsupported configs and broken model files give errors naming the problem."""

import json
import shutil

import pytest

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.errors import ConfigError, ModelLoadError
from edgecore.shared.models.loader import load_model

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 128}


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"hidden_act": "xielu"}, "hidden_act"),
    ({"architectures": ["GptOssForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
      "hidden_act": "gelu"}, "hidden_act"),       # its experts are a clamped SwiGLU
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": -2}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "llama3"}}, "rope_scaling.factor"),
    ({"hidden_size": True}, "hidden_size"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"architectures": ["Qwen2ForCausalLM"], "layer_types": ["full_attention", "chunked_attention"]},
     "attention_chunk_size"),
    ({"layer_types": ["full_attention", "banded"]}, r"layer_types\[1\]"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 2, "moe_intermediate_size": 8},
     "num_experts"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": "8", "num_experts_per_tok": 2},
     "num_local_experts"),
    ({"architectures": ["Llama4ForConditionalGeneration"]}, "text_config"),
    ({"architectures": ["Llama4ForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 1,
      "intermediate_size_mlp": 8, "no_rope_layers": [1, 0, 1]}, "no_rope_layers"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"head_dim": 7}, "head_dim"),
])
def test_unsupported_values_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as info:
        ModelConfig.from_dict({**BASE, **change})
    assert "\n" not in str(info.value)


def test_dynamic_rope_is_served_up_to_the_trained_length_only(model_dir, tmp_path):
    from edgecore.shared.models.config import EngineConfig
    from edgecore.shared.engine.engine import LLMEngine
    shutil.copytree(model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert LLMEngine.from_dir(tmp_path / "m", "fp32", "cpu").max_model_len == cfg["max_position_embeddings"]
    with pytest.raises(ConfigError, match="dynamic NTK"):
        LLMEngine.from_dir(tmp_path / "m", "fp32", "cpu",
                           engine_config=EngineConfig(max_model_len=2 * cfg["max_position_embeddings"]))


def test_published_llama4_text_config_reads():
    """Scout's config.json as published: multimodal wrapper, `no_rope_layers: []`, an int for
    attn_temperature_tuning, llama3 RoPE with equal low/high frequency factors."""
    text = {**BASE, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
            "intermediate_size_mlp": 256, "attention_chunk_size": 8192, "no_rope_layers": [],
            "attn_temperature_tuning": 4, "max_position_embeddings": 10485760,
            "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    del text["architectures"]
    config = ModelConfig.from_dict({"architectures": ["Llama4ForConditionalGeneration"], "text_config": text})
    assert [a.kind for a in config.layer_attention] == ["chunked", "chunked", "chunked", "full"]
    assert config.rope_scaling.rope_type == "llama3" and config.params.intermediate_size_mlp == 256


def test_missing_field_is_named():
    raw = dict(BASE)
    del raw["intermediate_size"]
    with pytest.raises(ConfigError, match="intermediate_size"):
        ModelConfig.from_dict(raw)


def test_missing_and_corrupt_model_files(tmp_path, model_dir):
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)
    broken = tmp_path / "m"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(broken)


def test_truncated_checkpoint_names_missing_tensor(tmp_path, model_dir):
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "m"
    shutil.copytree(model_dir, broken)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.2.mlp.down_proj.weight"):
        load_model(broken)


def test_sharded_checkpoint_loads(tmp_path, model_dir):
    from safetensors.torch import load_file, save_file
    out = tmp_path / "sharded"
    shutil.copytree(model_dir, out)
    (out / "model.safetensors").unlink()
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_model(model_dir), load_model(out)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and (pa == pb).all()


def test_dtype_selection(model_dir):
    import torch
    assert next(load_model(model_dir, "bf16").parameters()).dtype == torch.bfloat16
    assert next(load_model(model_dir, "fp16").parameters()).dtype == torch.float16
    with pytest.raises(ConfigError, match="dtype"):
        load_model(model_dir, "int3")


def test_fingerprint_is_stable_and_model_specific(tmp_path, model_dir):
    from tests.helpers import random_hf_checkpoint
    from edgecore.shared.models.fingerprint import model_fingerprint
    a = model_fingerprint(model_dir)
    assert a == model_fingerprint(model_dir) and len(a) == 64
    other, _ = random_hf_checkpoint(tmp_path, "llama")
    assert model_fingerprint(other) != a


def test_checkpoint_tensors_nothing_reads_are_reported(tmp_path, caplog):
    """A config that disagrees with its checkpoint (biases it does not declare) loads as transformers loads it,
    and the ignored tensors are named in one warning rather than dropped silently."""
    import logging
    from tests.helpers import random_hf_checkpoint
    path, _ = random_hf_checkpoint(tmp_path, "llama", attention_bias=True)
    with caplog.at_level(logging.WARNING, logger="edgecore.models"):
        load_model(path)
    assert not [r for r in caplog.records if "match nothing" in r.getMessage()]
    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_bias"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="edgecore.models"):
        load_model(path)
    (record,) = [r for r in caplog.records if "match nothing" in r.getMessage()]
    assert "8 checkpoint tensor(s)" in record.getMessage() and "self_attn.q_proj.bias" in record.getMessage()
