"""Frozen configuration objects.

Life cycle: a `ModelConfig` is read once from a Hugging Face `config.json`
(`ModelConfig.from_dir`), validated there (every unsupported value raises
`ConfigError` naming the field), and then passed read-only to the model,
the KV pool and the engine. `CacheConfig` and `EngineConfig` hold the
runtime knobs of the paged cache and the scheduler.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgecore.shared.errors import ConfigError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    mla: Any = None    # MLA models (DeepSeek): their `DeepseekConfig` (shared/models/mla_config.py)

    def kv_bytes_per_token(self, value_bytes: int = 2) -> int:
        """Bytes of K and V (of the latent, for MLA) per token over all layers, at `value_bytes` per value."""
        if self.mla is not None:
            return self.num_hidden_layers * self.mla.latent_dim * value_bytes
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * value_bytes

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"model directory {model_dir} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        gen_path = Path(model_dir) / "generation_config.json"
        gen = {}
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                gen = {}
        return cls.from_dict(raw, generation=gen, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict | None = None,
                  source: str = "config.json") -> "ModelConfig":
        def need(key: str, kind=int):
            if key not in raw:
                raise ConfigError(f"{source}: missing field '{key}'")
            value = raw[key]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
            if kind is float and not isinstance(value, (int, float)):
                raise ConfigError(f"{source}: field '{key}' must be a number, got {value!r}")
            return value

        archs = raw.get("architectures") or []
        if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: field 'architectures' = {archs!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        arch = archs[0]
        mla = None
        if SUPPORTED_ARCHITECTURES[arch] == "deepseek":
            from edgecore.shared.models.mla_config import generic_fields, parse_deepseek
            mla = parse_deepseek(raw, arch, source)
            raw = generic_fields(raw, mla)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' = {act!r} is not supported (only 'silu')")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: field 'mlp_bias' = true is not supported")
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise ConfigError(f"{source}: field 'pretraining_tp' must be 1")

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(
                f"{source}: field 'num_key_value_heads' = {kv_heads!r} must divide "
                f"num_attention_heads = {heads}")
        head_dim = raw.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"{source}: field 'head_dim' = {head_dim!r} must be a positive even integer")

        rope = _parse_rope_scaling(raw.get("rope_scaling"), source)
        rope_theta = raw.get("rope_theta", 10000.0)
        if isinstance(raw.get("rope_parameters"), dict):  # newer HF layout
            params = raw["rope_parameters"]
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default" and raw.get("rope_scaling") is None:
                rope = _parse_rope_scaling(params, source)
        if not isinstance(rope_theta, (int, float)) or rope_theta <= 0:
            raise ConfigError(f"{source}: field 'rope_theta' = {rope_theta!r} must be a positive number")

        family = SUPPORTED_ARCHITECTURES[arch]
        if family == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            attn_bias = bool(raw.get("attention_bias", False))
            qkv_bias, o_bias = attn_bias, attn_bias

        sliding = raw.get("sliding_window")
        if family == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None
        max_pos = need("max_position_embeddings")
        if sliding is not None:
            if not isinstance(sliding, int) or sliding <= 0:
                raise ConfigError(f"{source}: field 'sliding_window' = {sliding!r} must be a positive integer")
            if sliding >= max_pos:
                sliding = None

        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(dtype),
            mla=mla,
        )


def _parse_rope_scaling(raw: Any, source: str) -> RopeScaling:
    if raw is None:
        return RopeScaling()
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object or null")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: field 'rope_scaling.rope_type' = {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    factor = raw.get("factor", 1.0)
    if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"{source}: field 'rope_scaling.factor' = {factor!r} must be a positive number")
    return RopeScaling(
        rope_type=kind,
        factor=float(factor),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry: `num_blocks` blocks of `block_size` tokens each."""
    block_size: int = 16
    num_blocks: int = 2048
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits: tokens per step (chunked prefill budget) and sequences per step."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
