"""The architecture registry: `architectures[0]` of a config.json → family fields and model class.

Life cycle: `ModelConfig.from_dict` looks an architecture up here (an unknown one is a config
error listing the supported ones) and decodes the family's own fields with `Arch.params`; the
loader later imports the model class named by `Arch.model` (kept as a string so that reading a
config never imports torch). Adding an architecture is one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgecore.shared.models.params import GptOssParams, Llama4Params, MixtralParams, Qwen3MoeParams

if TYPE_CHECKING:
    from edgecore.shared.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Arch:
    model: str                    # "module:Class" of the model
    params: type | None = None    # msgspec Struct of the family's own config.json fields
    qkv_bias: bool | None = None  # fixed by the family (Qwen2), else `attention_bias`
    qk_norm: bool = False         # per-head RMSNorm on q and k (Qwen3)
    text_prefix: str = ""         # weights live under this prefix (multimodal checkpoints' text part)
    sub_config: str = ""          # the text model's fields live under this key of config.json
    mla: bool = False             # multi-head latent attention: config read by shared/models/mla_config.py
    silu_only: bool = False       # its experts' activation is fixed (gpt-oss's clamped SwiGLU): `hidden_act` silu
    mlp_bias: bool = False        # reads config.json's `mlp_bias` (Llama; the others have none)
    windows: str = "none"         # which layers slide, and by which fields (config.py `_layer_attention`)
    window_default: int | None = None   # transformers' `sliding_window` when config.json has none
    defaults: dict[str, Any] = field(default_factory=dict)   # transformers' values for fields config.json lacks

    def model_class(self) -> type[LlamaForCausalLM]:
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)


_LLAMA = "edgecore.shared.models.llama:LlamaForCausalLM"
# Where a family's config class defaults differ from HFConfig's (rope_theta 10000, rms_norm_eps 1e-6, no biases):
# a config.json without the field means these (tests/shared/test_config_semantics.py).
_MIXTRAL_DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5}
_LLAMA4_DEFAULTS = {"rope_theta": 5e5, "rms_norm_eps": 1e-5}
_GPT_OSS_DEFAULTS = {"rope_theta": 150000.0, "rms_norm_eps": 1e-5, "attention_bias": True,
                     "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096}}
ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": Arch(_LLAMA, mlp_bias=True),
    # transformers builds Mistral's and Mixtral's projections without biases, whatever `attention_bias` says
    "MistralForCausalLM": Arch(_LLAMA, qkv_bias=False, windows="all", window_default=4096),
    "Qwen2ForCausalLM": Arch(_LLAMA, qkv_bias=True, windows="qwen", window_default=4096),
    "Qwen3ForCausalLM": Arch(_LLAMA, qk_norm=True, windows="qwen", window_default=4096),
    "MixtralForCausalLM": Arch("edgecore.shared.models.mixtral:MixtralForCausalLM", MixtralParams, qkv_bias=False,
                               windows="all", defaults=_MIXTRAL_DEFAULTS),
    "Qwen3MoeForCausalLM": Arch("edgecore.shared.models.qwen3_moe:Qwen3MoeForCausalLM", Qwen3MoeParams,
                                qk_norm=True, windows="qwen_moe", window_default=4096),
    "GptOssForCausalLM": Arch("edgecore.shared.models.gpt_oss:GptOssForCausalLM", GptOssParams,
                              windows="alternating", window_default=128, silu_only=True,
                              defaults=_GPT_OSS_DEFAULTS),
    "Llama4ForCausalLM": Arch("edgecore.shared.models.llama4:Llama4ForCausalLM", Llama4Params, windows="chunked",
                              defaults=_LLAMA4_DEFAULTS),
    "Llama4ForConditionalGeneration": Arch("edgecore.shared.models.llama4:Llama4ForCausalLM", Llama4Params,
                                           text_prefix="language_model.", sub_config="text_config",
                                           windows="chunked", defaults=_LLAMA4_DEFAULTS),
    "DeepseekV2ForCausalLM": Arch("edgecore.shared.models.deepseek:DeepseekForCausalLM", mla=True, mlp_bias=True),
    "DeepseekV3ForCausalLM": Arch("edgecore.shared.models.deepseek:DeepseekForCausalLM", mla=True),
}
