"""DeepSeek-V2/V3 (MLA + MoE): fp32 logits within 1e-4 of transformers over the prompt and 24 decode steps
(decode in latent space with the up-projections absorbed, prefill expanded), greedy identical, a cache of
latent vectors only, and config validation."""

import json

import pytest
import torch

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import ConfigError
from tests.conftest import make_engine
from tests.helpers import stepwise_logits
from tests.shared.deepseek_checkpoints import CONFIGS, deepseek_checkpoint

transformers = pytest.importorskip("transformers")
GREEDY24 = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(hf, ids: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, start - 1:]


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return deepseek_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    engine = make_engine(path, block_size=16, num_blocks=64)
    for prompt_len in (5, 600):
        ids = random_ids(prompt_len + 24, prompt_len)
        ours = stepwise_logits(engine, ids, prompt_len)       # one prefill, then 24 absorbed decode steps
        ref = reference_logits(hf, ids, prompt_len)
        err = (ours - ref).abs().max().item()
        top2 = ref.topk(2, dim=-1).values
        assert err <= 1e-4, prompt_len
        assert (top2[:, 0] - top2[:, 1]).min().item() > 20 * err     # greedy choices are not near ties


@pytest.mark.parametrize("name", ["v3-qlora-yarn-grouped", "v2-no-qlora-grouped"])
def test_greedy_identical_batched_and_chunked(tmp_path, name):
    """Several prompts in one batch (decode rows of different lengths), the long one prefilled in chunks
    that attend to cached latents: each continuation equals transformers' greedy one."""
    path, hf = deepseek_checkpoint(tmp_path, name)
    engine = make_engine(path, block_size=8, num_blocks=256, budget=128)
    prompts = [random_ids(n, 100 + n) for n in (5, 77, 300)]
    ours = engine.generate(prompts, GREEDY24)
    for ids, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert got["token_ids"] == ref


def test_kimi_k2_model_type_is_accepted(tmp_path):
    path, hf = deepseek_checkpoint(tmp_path, "v3-qlora-yarn-grouped", model_type="kimi_k2")
    assert ModelConfig.from_dir(path).mla.version == 3
    engine = make_engine(path, block_size=16, num_blocks=16)
    ids = random_ids(30, 7)
    assert (stepwise_logits(engine, ids, 20) - reference_logits(hf, ids, 20)).abs().max().item() <= 1e-4


def test_cache_holds_latent_vectors_only(tmp_path):
    path, _ = deepseek_checkpoint(tmp_path, "v3-qlora-yarn-grouped")
    config = ModelConfig.from_dir(path)
    engine = make_engine(path, block_size=16, num_blocks=8)
    pool, mla = engine.pool, config.mla
    width = mla.kv_lora_rank + mla.qk_rope_head_dim          # 32 + 8: one vector per token per layer
    assert pool.layout.latent and [tuple(t.shape) for t in pool.latent] == [(128, 1, width)] * 3
    assert pool.bytes == 3 * 128 * width * 4                  # float32, nothing else allocated
    assert config.kv_bytes_per_token(2) == 3 * width * 2
    # The dense model of the same hidden size (4 heads of 16) caches 2 * 4 * 16 values per token per layer.
    dense = 2 * config.num_hidden_layers * config.num_attention_heads * (config.hidden_size // 4) * 2
    assert config.kv_bytes_per_token(2) * 3 < dense
    # The cached latent is what the attention wrote: read back through the pool's planes.
    out = engine.generate([random_ids(20, 3)], SamplingParams(max_tokens=1))
    assert out and pool.k[0].shape[-1] == mla.kv_lora_rank and pool.v[0].shape[-1] == mla.qk_rope_head_dim


def _raw(path):
    return json.loads((path / "config.json").read_text())


def test_config_errors_name_the_field(tmp_path):
    path, _ = deepseek_checkpoint(tmp_path, "v3-qlora-yarn-grouped")
    raw = _raw(path)
    cases = [
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"kv_lora_rank": "wide"}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 9}, "topk_group"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),      # no weight_block_size
        ({"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"}, "topk_method"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    ]
    for change, field in cases:
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_dict({**raw, **change})


def test_older_rope_scaling_form(tmp_path):
    """Original DeepSeek configs: `rope_scaling` {type: yarn, ...} beside a top-level `rope_theta`."""
    path, _ = deepseek_checkpoint(tmp_path, "v3-qlora-yarn-grouped")
    raw = _raw(path)
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params
    old = ModelConfig.from_dict(raw).mla
    assert old == ModelConfig.from_dir(path).mla
    assert old.rope.rope_type == "yarn" and old.rope.factor == 4.0


def test_published_deepseek_v3_and_kimi_k2_configs_parse():
    """The config.json fields of DeepSeek-V3 (original format) and Kimi K2 (its own model_type, 384 experts):
    parsed, and their latent cache is 576 values per token per layer (70,272 bytes per token in bf16)."""
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
          "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
          "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
          "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
          "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
          "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
          "rms_norm_eps": 1e-06, "rope_theta": 10000, "bos_token_id": 0, "eos_token_id": 1,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"}}
    config = ModelConfig.from_dict(v3)
    assert config.num_key_value_heads == 1 and config.kv_bytes_per_token(2) == 70272
    assert config.mla.is_moe_layer(3) and not config.mla.is_moe_layer(2)
    assert config.mla.softmax_scale() == pytest.approx(192 ** -0.5 * (0.1 * __import__("math").log(40) + 1) ** 2)
    k2 = ModelConfig.from_dict({**v3, "model_type": "kimi_k2", "n_routed_experts": 384, "n_group": 1,
                                "topk_group": 1, "num_attention_heads": 64, "rope_scaling": {
                                    "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                    "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                                "rope_theta": 50000.0})
    assert k2.mla.n_routed_experts == 384 and k2.kv_bytes_per_token(2) == 70272
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert ModelConfig.from_dict({**v3, "quantization_config": fp8}).mla.fp8_block == (128, 128)
    with pytest.raises(ConfigError, match="quantization_config"):
        ModelConfig.from_dict({**v3, "quantization_config": {**fp8, "activation_scheme": "static"}})
