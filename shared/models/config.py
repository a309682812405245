"""Frozen configuration objects.

Life cycle: a `ModelConfig` is read once from a Hugging Face `config.json`
(`ModelConfig.from_dir`): the JSON object is decoded into msgspec Structs with
constraints (`HFConfig` for the fields every family shares, `RopeParams` for
either `rope_theta` + `rope_scaling` or transformers 5's `rope_parameters`,
and the family's own Struct from the architecture registry), so that every
wrong or unsupported value is one `ConfigError` naming the field. The result is
passed read-only to the model, the KV pool, the block manager and the engine.
`CacheConfig` and `EngineConfig` hold the runtime knobs of the paged cache and
the scheduler.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import msgspec

from edgecore.shared.errors import ConfigError

if TYPE_CHECKING:
    from edgecore.shared.models.registry import Arch

_T = TypeVar("_T")

PosInt = Annotated[int, msgspec.Meta(gt=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
# "dynamic" (dynamic NTK) is the default rotation up to max_position_embeddings, the only span served
# with it (transformers rescales beyond that length alone).
RopeType = Literal["default", "linear", "llama3", "yarn", "dynamic"]
# transformers' ACT2FN names the MLPs and experts take (shared/models/activation.py); gpt-oss is SiLU only.
HiddenAct = Literal["silu", "swish", "gelu", "gelu_python", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new",
                    "gelu_accurate", "gelu_fast", "gelu_10", "quick_gelu", "relu", "relu2", "relu6", "leaky_relu",
                    "sigmoid", "tanh", "mish", "hardswish", "linear"]
LayerType = Literal["full_attention", "sliding_attention", "chunked_attention"]


class RopeParams(msgspec.Struct, frozen=True):
    """`rope_scaling` (most published checkpoints) or `rope_parameters` (transformers 5)."""
    rope_type: RopeType = "default"
    rope_theta: PosFloat | None = None
    factor: PosFloat | None = None
    low_freq_factor: PosFloat = 1.0
    high_freq_factor: PosFloat = 4.0
    original_max_position_embeddings: PosInt | None = None
    beta_fast: PosFloat | None = None
    beta_slow: PosFloat | None = None
    attention_factor: PosFloat | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: Annotated[float, msgspec.Meta(ge=1, le=1)] = 1.0   # partial rotation: unsupported


class HFConfig(msgspec.Struct, frozen=True):
    """The config.json fields every supported family reads (unknown fields are ignored)."""
    architectures: Annotated[list[str], msgspec.Meta(min_length=1)]
    vocab_size: PosInt
    hidden_size: PosInt
    num_hidden_layers: PosInt
    num_attention_heads: PosInt
    max_position_embeddings: PosInt
    intermediate_size: PosInt | None = None
    num_key_value_heads: PosInt | None = None
    head_dim: PosInt | None = None
    rms_norm_eps: PosFloat = 1e-6
    rope_theta: PosFloat | None = None
    rope_scaling: RopeParams | None = None
    rope_parameters: RopeParams | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: HiddenAct = "silu"
    pretraining_tp: PosInt | None = 1         # transformers computes the same with any value
    original_max_position_embeddings: PosInt | None = None    # Phi-3 style, outside the RoPE dict
    sliding_window: PosInt | None | msgspec.UnsetType = msgspec.UNSET    # absent: the family's default
    use_sliding_window: bool | None = False     # null reads as false
    max_window_layers: Annotated[int, msgspec.Meta(ge=0)] | None = None     # Qwen2: layers from here slide
    layer_types: list[LayerType] | None = None
    attention_chunk_size: PosInt | None | msgspec.UnsetType = msgspec.UNSET    # absent: 8192 (Llama 4)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None     # yarn: cos/sin scale (None: from factor and mscale)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class LayerAttention:
    """What one layer attends to: everything (`full`), the last `size` positions (`sliding`), or the
    positions of its own `size`-token chunk (`chunked`)."""
    kind: str = "full"
    size: int = 0

    def first_visible(self, position: int) -> int:
        """The first position a query at `position` attends to."""
        if self.kind == "sliding":
            return max(0, position - self.size + 1)
        if self.kind == "chunked":
            return position - position % self.size
        return 0


FULL = LayerAttention()


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
    qk_norm: bool = False
    mlp_bias: bool = False                     # biases on the dense MLP's projections (Llama's mlp_bias)
    hidden_act: str = "silu"                   # the MLPs' and experts' activation (transformers' name)
    sliding_window: int | None = None          # the window of the sliding layers, if any
    layer_attention: tuple[LayerAttention, ...] = ()
    params: Any = None                         # the family's own fields (shared/models/params.py)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    mla: Any = None    # MLA models (DeepSeek): their `DeepseekConfig` (shared/models/mla_config.py)

    def kv_bytes_per_token(self, value_bytes: float = 2) -> int:
        """Bytes of K and V (of the latent, for MLA) per token over all layers, at `value_bytes` per value (a
        quantized pool's: one byte plus its share of a scale)."""
        if self.mla is not None:
            return math.ceil(self.num_hidden_layers * self.mla.latent_dim * value_bytes)
        return math.ceil(2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * value_bytes)

    def attention_of(self, layer: int) -> LayerAttention:
        return self.layer_attention[layer] if self.layer_attention else FULL

    @property
    def releases_kv(self) -> bool:
        """Every layer windowed or chunked: a running sequence's oldest KV blocks can be released."""
        return self.first_needed_position(1 << 40) > 0

    def first_needed_position(self, position: int) -> int:
        """The first position any layer still attends to from a query at `position` (0 if some layer
        sees everything): KV before it can be dropped."""
        kinds = set(self.layer_attention) or {FULL}
        return min(k.first_visible(position) for k in kinds)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        if str(model_dir).endswith(".gguf"):     # a GGUF file: its metadata as config.json (shared/models/gguf_file.py)
            from edgecore.shared.errors import ModelLoadError
            from edgecore.shared.models.gguf_file import GGUFFile
            try:
                return cls.from_dict(GGUFFile(model_dir).hf_config(), source=str(model_dir))
            except ModelLoadError as exc:
                raise ConfigError(str(exc)) from None
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
        return cls.from_dict(raw, generation=gen if isinstance(gen, dict) else {}, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict | None = None,
                  source: str = "config.json") -> ModelConfig:
        from edgecore.shared.models.registry import ARCHITECTURES
        archs = raw.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{source}: field 'architectures' = {archs!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        spec = ARCHITECTURES[arch]
        text = raw
        if spec.sub_config:
            sub = raw.get(spec.sub_config)
            if not isinstance(sub, dict):
                raise ConfigError(f"{source}: field '{spec.sub_config}' must be an object")
            text = {**sub, "architectures": archs}
        text = _with_defaults(text, spec.defaults)
        mla = None
        if spec.mla:                      # DeepSeek: its own fields (shared/models/mla_config.py)
            from edgecore.shared.models.mla_config import generic_fields, parse_deepseek
            mla = parse_deepseek(text, arch, source)
            text = generic_fields(text, mla)
        hf = _decode(_legacy_rope_keys(text), HFConfig, source)
        params = _decode(text, spec.params, source) if spec.params is not None else None
        return _build(arch, spec, hf, params, generation or {}, source, mla)


def _decode(raw: dict, kind: type[_T], source: str) -> _T:
    try:
        return msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$")
        name = where.rstrip("`").lstrip(".")
        if not name and "missing required field" in message:
            name = message.split("`")[1]
            raise ConfigError(f"{source}: missing field '{name}'") from None
        raise ConfigError(f"{source}: field '{name}': {message}") from None


def _with_defaults(raw: dict, defaults: dict) -> dict:
    """config.json with the family's defaults for the fields it lacks (or sets to null), as transformers'
    config class fills them; a default RoPE dict only when the file has neither `rope_scaling` nor
    `rope_parameters`."""
    rope_keys = ("rope_scaling", "rope_parameters")
    missing = {k: v for k, v in defaults.items() if raw.get(k) is None
               and not (k in rope_keys and any(raw.get(r) is not None for r in rope_keys))}
    return {**raw, **missing} if missing else raw


def _legacy_rope_keys(raw: dict) -> dict:
    """Old checkpoints spell `rope_scaling.rope_type` as `type`."""
    rope = raw.get("rope_scaling")
    if isinstance(rope, dict) and "type" in rope and "rope_type" not in rope:
        rope = {("rope_type" if k == "type" else k): v for k, v in rope.items()}
        return {**raw, "rope_scaling": rope}
    return raw


def _rope(hf: HFConfig, source: str) -> tuple[float, RopeScaling]:
    """rope_theta and the scaling, from either layout, as transformers reads them: `rope_scaling` wins when
    both dicts are set, and the dict's `rope_theta` wins over a top-level one."""
    params = hf.rope_scaling or hf.rope_parameters or RopeParams()
    theta = params.rope_theta or hf.rope_theta
    kind = params.rope_type
    if kind in ("linear", "llama3") and params.factor is None:
        raise ConfigError(f"{source}: field 'rope_scaling.factor' is required for rope_type '{kind}'")
    # As transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3 style) wins,
    # then the RoPE dict's, then max_position_embeddings; YaRN without a factor scales to max_position_embeddings.
    original = params.original_max_position_embeddings
    if kind in ("llama3", "yarn"):
        original = hf.original_max_position_embeddings or original or hf.max_position_embeddings
    factor = params.factor
    if factor is None and kind == "yarn":
        assert original is not None      # set above for yarn
        factor = hf.max_position_embeddings / original
    elif factor is None:
        factor = 1.0
    return float(theta or 10000.0), RopeScaling(
        rope_type=kind, factor=factor, low_freq_factor=params.low_freq_factor,
        high_freq_factor=params.high_freq_factor, original_max_position_embeddings=original or 8192,
        beta_fast=params.beta_fast or 32.0, beta_slow=params.beta_slow or 1.0,
        attention_factor=params.attention_factor, mscale=params.mscale, mscale_all_dim=params.mscale_all_dim,
        truncate=params.truncate)


def _layer_attention(hf: HFConfig, spec: Arch, params: Any, source: str) -> tuple[LayerAttention, ...]:
    """Each layer's attention form by the family's rule (`Arch.windows`), as transformers reads the config:
    - "none" (Llama, DeepSeek): full attention, whatever window fields the config carries;
    - "all" (Mistral, Mixtral): `sliding_window` on every layer (`use_sliding_window`, `layer_types` ignored);
    - "qwen" (Qwen2, Qwen3): a window only with `use_sliding_window`; `layer_types`, else the layers from
      `max_window_layers` on (default 28) slide;
    - "qwen_moe" (Qwen3-MoE): with `use_sliding_window`, every layer slides;
    - "alternating" (gpt-oss): `layer_types`, else sliding and full layers alternate, sliding first;
    - "chunked" (Llama 4): `layer_types`, else chunked layers where RoPE is used (`attention_chunk_size`).
    An absent `sliding_window` is the family's default (`Arch.window_default`); a window as long as the
    context is full attention."""
    n = hf.num_hidden_layers
    if params is not None and hasattr(params, "uses_rope") and len(params.uses_rope(n)) != n:
        raise ConfigError(f"{source}: field 'no_rope_layers' needs one entry per layer ({n})")
    rule = spec.windows
    chunk = hf.attention_chunk_size
    if chunk is msgspec.UNSET:
        chunk = 8192 if rule == "chunked" else None     # transformers' Llama4TextConfig default
    window = spec.window_default if hf.sliding_window is msgspec.UNSET else hf.sliding_window
    if rule in ("none", "chunked") or (rule in ("qwen", "qwen_moe") and not hf.use_sliding_window):
        window = None
    if window is not None and window >= hf.max_position_embeddings:
        window = None
    if rule in ("all", "qwen_moe", "none"):
        return (FULL if window is None else LayerAttention("sliding", window),) * n
    types = hf.layer_types
    if types is None and rule == "qwen":
        start = 28 if hf.max_window_layers is None else hf.max_window_layers
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    elif types is None and rule == "alternating":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if types is None:           # "chunked" without layer_types
        if params is not None and hasattr(params, "uses_rope") and chunk:
            return tuple(LayerAttention("chunked", chunk) if rope else FULL
                         for rope in params.uses_rope(n))
        return (FULL,) * n
    if len(types) != n:
        raise ConfigError(f"{source}: field 'layer_types' has {len(types)} entries, num_hidden_layers is {n}")
    out = []
    for i, kind in enumerate(types):
        if kind == "chunked_attention":
            if chunk is None:
                raise ConfigError(f"{source}: field 'layer_types[{i}]' = {kind!r} needs 'attention_chunk_size'")
            out.append(LayerAttention("chunked", chunk))
        else:           # a sliding layer without a window attends to everything, as in transformers
            out.append(LayerAttention("sliding", window) if kind == "sliding_attention" and window else FULL)
    return tuple(out)


def _build(arch: str, spec: Arch, hf: HFConfig, params: Any, generation: dict, source: str,
           mla: Any = None) -> ModelConfig:
    heads = hf.num_attention_heads
    kv_heads = hf.num_key_value_heads or heads
    if heads % kv_heads:
        raise ConfigError(f"{source}: field 'num_key_value_heads' = {kv_heads} must divide "
                          f"num_attention_heads = {heads}")
    head_dim = hf.head_dim or hf.hidden_size // heads
    if head_dim % 2:
        raise ConfigError(f"{source}: field 'head_dim' = {head_dim} must be even")
    if hf.intermediate_size is None:
        raise ConfigError(f"{source}: missing field 'intermediate_size'")
    theta, rope = _rope(hf, source)
    if hf.hidden_act not in ("silu", "swish") and spec.silu_only:
        raise ConfigError(f"{source}: field 'hidden_act' = {hf.hidden_act!r}: {arch} is served with 'silu' only")
    if rope.rope_type == "dynamic" and spec.mla:
        raise ConfigError(f"{source}: rope_type 'dynamic' is not supported for {arch}")
    layers = _layer_attention(hf, spec, params, source)
    windows = {a.size for a in layers if a.kind == "sliding"}
    qkv_bias = spec.qkv_bias if spec.qkv_bias is not None else hf.attention_bias
    eos = generation.get("eos_token_id", hf.eos_token_id)
    eos_ids = tuple(e for e in eos if isinstance(e, int)) if isinstance(eos, list) else \
        ((eos,) if isinstance(eos, int) and not isinstance(eos, bool) else ())
    return ModelConfig(
        architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=hf.max_position_embeddings, rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta, rope_scaling=rope, tie_word_embeddings=hf.tie_word_embeddings,
        qkv_bias=qkv_bias, o_bias=hf.attention_bias if spec.qkv_bias is None else False,
        qk_norm=spec.qk_norm, mlp_bias=hf.mlp_bias and spec.mlp_bias, hidden_act=hf.hidden_act,
        sliding_window=max(windows) if windows else None,
        layer_attention=layers, params=params, bos_token_id=hf.bos_token_id, eos_token_ids=eos_ids,
        torch_dtype=str(hf.torch_dtype or hf.dtype or "float32"), mla=mla)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry: `num_blocks` blocks of `block_size` tokens each; `resident_blocks`: blocks ever
    touched before cached blocks are evicted rather than new pages touched (None: all of them; block_manager.py);
    `tier_*`: the disk tier evicted cached blocks spill to (shared/kv/tier.py)."""
    block_size: int = 16
    num_blocks: int = 2048
    enable_prefix_caching: bool = True
    resident_blocks: int | None = None
    tier_dir: str | None = None         # the disk KV tier (shared/kv/tier.py): its directory, None: no tier
    tier_bytes: int = 0                 # its size bound
    tier_codec: str = "lossless"        # the wire codec its blocks are stored with
    kv_dtype: str | None = None         # "int8" / "fp8": a quantized pool (shared/kv/quant_cache.py); None: the model's


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (shared/engine/speculative.py), as vLLM's `--speculative-config` names it: up to
    `num_speculative_tokens` drafted per step, by prompt lookup (`ngram`: from the latest earlier occurrence of
    the last `prompt_lookup_max` .. `prompt_lookup_min` tokens) or by a small model (`draft_model`: the model
    directory `model`, shared/engine/draft_model.py); a sequence whose drafts do not pay pauses drafting
    (`min_acceptance`: the acceptance rate that decides before step costs are measured)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    min_acceptance: float = 0.2
    model: str | None = None

    @classmethod
    def parse(cls, text: str | None, draft_model: str | None = None) -> SpeculativeConfig | None:
        """`--speculative-config JSON` (vLLM's flag and keys; unset fields take the defaults above) and
        `--draft-model DIR` (the same as method draft_model with that model), checked."""
        if not text and not draft_model:
            return None
        try:
            fields = msgspec.json.decode(text or "{}", type=dict[str, Any])
        except msgspec.DecodeError as exc:
            raise ConfigError(f"--speculative-config: not a JSON object ({exc})") from None
        if draft_model:
            fields.update(method="draft_model", model=draft_model)
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown keys {sorted(unknown)} (known: "
                              f"{sorted(cls.__dataclass_fields__)})")
        spec = cls(**fields)
        if spec.method not in ("ngram", "draft_model"):
            raise ConfigError(f"--speculative-config: method {spec.method!r} is not supported ('ngram', prompt "
                              "lookup, or 'draft_model' with `model`)")
        if spec.method == "draft_model" and not (isinstance(spec.model, str) and spec.model):
            raise ConfigError("--speculative-config: method 'draft_model' needs `model`, the draft model's "
                              "directory (or give --draft-model DIR)")
        ints = (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in ints) \
                or spec.prompt_lookup_min > spec.prompt_lookup_max:
            raise ConfigError("--speculative-config: num_speculative_tokens, prompt_lookup_min and prompt_lookup_max "
                              "are integers >= 1, with prompt_lookup_min <= prompt_lookup_max")
        if not isinstance(spec.min_acceptance, (int, float)) or not 0 <= spec.min_acceptance <= 1:
            raise ConfigError("--speculative-config: min_acceptance is a number in [0, 1]")
        return spec


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits: tokens per step (chunked prefill budget) and sequences per step; whether small decode
    steps run compiled."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    compile_decode: bool = False        # small pure decode steps through torch.compile (compiled_decode.py)
    quantize: str | None = None         # "int8" / "int4": float projections quantized at load (quant_loader.py)
    speculative: SpeculativeConfig | None = None    # drafts verified per step (shared/engine/speculative.py)
