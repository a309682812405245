"""RoPE tables start small and grow on demand to exactly the tables computed at full size."""

import torch

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models import llama
from edgecore.shared.models.loader import build_model
from edgecore.shared.models.rope import rope_cos_sin

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 100,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 25}}


def test_tables_grow_on_demand(monkeypatch):
    monkeypatch.setattr(llama, "ROPE_TABLE_START", 8)
    config = ModelConfig.from_dict(CONFIG)
    model = build_model(config, torch.float32, "cpu")
    assert model.rope_cos.shape[0] == 8
    positions = torch.tensor([3, 60, 7])
    cos, sin = model.rope_inputs(positions, torch.float32)
    full_cos, full_sin = rope_cos_sin(config, 100)
    assert model.rope_cos.shape[0] >= 61
    assert torch.equal(cos[:, 0], full_cos[positions]) and torch.equal(sin[:, 0], full_sin[positions])
