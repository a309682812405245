"""A LoRA adapter's files (PEFT format) checked against a base model's config, without loading a tensor.

Life cycle: a node's start-up (`--lora NAME=DIR`, in the HTTP process too, which never imports torch) calls
`check_lora_flags`: each flag parsed (`lora_specs`), each adapter's `adapter_config.json` read and checked
(`check_config`: the fields this server honours, rank against `--max-lora-rank`) and its
`adapter_model.safetensors` header read (`check_files`: tensor names, target modules, layers, A/B pairs,
shapes against the model's projections), so a bad flag stops the start with one line before an engine loads
the model. The engine then loads the same files with shared/models/lora.py `read_adapter`, which runs `check_files`
first and reads the tensors only after it has passed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgecore.shared.errors import AdapterError, ConfigError

if TYPE_CHECKING:
    from edgecore.shared.models.config import ModelConfig

MAX_LORA_RANK = 64          # default of --max-lora-rank
# Our fused projection → the checkpoint projections it holds, in output order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
}
PART_OF = {part: fused for fused, parts in FUSED.items() for part in parts}
TARGETS = tuple(PART_OF)
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                   r"\.weight$")
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def parse_lora_spec(spec: str) -> tuple[str, str]:
    """`NAME=DIR` (the `--lora` flag) → (name, dir); a ValueError or AdapterError (bad name) otherwise."""
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise ValueError("expected NAME=DIR")
    check_name(name)
    return name, path


def lora_specs(specs: Iterable[str]) -> list[tuple[str, str]]:
    """The `--lora NAME=DIR` flags → (name, dir) pairs; a ConfigError (one line) for a malformed or repeated one."""
    pairs: list[tuple[str, str]] = []
    for spec in specs:
        try:
            name, path = parse_lora_spec(spec)
        except (ValueError, AdapterError) as exc:
            raise ConfigError(f"--lora {spec}: {exc}") from None
        if any(name == n for n, _ in pairs):
            raise ConfigError(f"--lora {spec}: adapter name '{name}' is given twice")
        pairs.append((name, path))
    return pairs


def check_lora_flags(specs: Iterable[str], config: ModelConfig, max_rank: int) -> list[tuple[str, str]]:
    """Start-up: `lora_specs`, then each adapter checked against the model's config (ConfigError, one line)."""
    if not 1 <= max_rank <= 1024:
        raise ConfigError(f"--max-lora-rank must be between 1 and 1024, not {max_rank}")
    pairs = lora_specs(specs)
    for name, path in pairs:
        try:
            check_files(name, path, config, max_rank)
        except AdapterError as exc:
            raise ConfigError(f"--lora {name}={path}: {exc}") from None
    return pairs


def check_name(name: str) -> None:
    if not _ADAPTER_NAME.match(name):
        raise AdapterError(f"adapter name {name!r}: use 1-128 letters, digits and . _ : / -", "lora_name")


def model_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of the base model (all ranks together: one rank only)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    inter = c.intermediate_size
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
            "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, inter), "up_proj": (c.hidden_size, inter),
            "down_proj": (inter, c.hidden_size)}


def read_config(path: Path) -> tuple[dict[str, Any], bytes]:
    file = path / "adapter_config.json"
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise AdapterError(f"{file}: cannot read ({exc.strerror or exc})") from None
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: not a JSON object")
    return config, raw


def check_config(config: dict[str, Any], file: Path, max_rank: int) -> tuple[int, float]:
    """(r, scaling) from a PEFT LoraConfig, or the first field this server cannot honour."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias={config.get('bias')!r} is not supported (only bias=\"none\")")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise AdapterError(f"{file}: {key}=true is not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"{file}: {key} is not supported")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{file}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"{file}: rank {r} exceeds the limit of {max_rank} (--max-lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scaling)


@dataclass
class AdapterFiles:
    """An adapter whose files passed `check_files`: its rank and scaling, its weights file, the tensor names of
    each (layer, projection)'s A and B, and its config's bytes (for its content fingerprint)."""
    rank: int
    scaling: float
    weights_file: Path
    pairs: dict[tuple[int, str], tuple[str, str]]
    raw_config: bytes


def check_files(name: str, path: str | Path, config: ModelConfig, max_rank: int = MAX_LORA_RANK,
                plain: tuple[bool, bool] = (True, True)) -> AdapterFiles:
    """The adapter at `path` checked against a model's config (`plain`: whether its attention and MLP are the
    plain Llama-family ones) from its config and its weights file's header alone, or an AdapterError naming
    the first problem."""
    from safetensors import SafetensorError, safe_open
    check_name(name)
    root = Path(path)
    peft_config, raw_config = read_config(root)
    r, scaling = check_config(peft_config, root / "adapter_config.json", max_rank)
    file = root / "adapter_model.safetensors"
    if not file.is_file():
        raise AdapterError(f"{file}: missing (the adapter's weights, PEFT's safetensors format)")
    shapes = model_shapes(config)
    plain_attn, plain_mlp = plain
    layers = config.num_hidden_layers
    found: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    try:
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                m = _NAME.match(key)
                if m is None:
                    raise AdapterError(f"{file}: tensor {key!r} is not a LoRA A/B of a decoder layer's projection")
                layer, proj, which = int(m.group(1)), m.group(3), m.group(4)
                if proj not in PART_OF:
                    raise AdapterError(f"{file}: target module {proj!r} is not one of {', '.join(TARGETS)}")
                if layer >= layers:
                    raise AdapterError(f"{file}: tensor {key!r} names layer {layer}; the base model has {layers}")
                if not (plain_attn if m.group(2) == "self_attn" else plain_mlp):
                    raise AdapterError(f"{file}: target module {proj!r}: the base model's {m.group(2)} is not the "
                                       f"plain Llama-family one LoRA applies to here")
                found.setdefault((layer, proj), {})[which] = (key, list(f.get_slice(key).get_shape()))
    except SafetensorError as exc:
        raise AdapterError(f"{file}: not a readable safetensors file ({exc})") from None
    if not found:
        raise AdapterError(f"{file}: holds no LoRA tensors")
    pairs: dict[tuple[int, str], tuple[str, str]] = {}
    for (layer, proj), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{file}: layer {layer} {proj} has lora_{next(iter(pair))} but not its pair")
        (a_key, a), (b_key, b) = pair["A"], pair["B"]
        fan_in, fan_out = shapes[proj]
        if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b[0] != fan_out or a[0] != b[1]:
            raise AdapterError(f"{file}: layer {layer} {proj}: A {tuple(a)} and B {tuple(b)} do not fit "
                               f"the base model's {fan_in} → {fan_out} projection")
        if a[0] != r:
            raise AdapterError(f"{file}: layer {layer} {proj} has rank {a[0]}, the config says r={r}")
        pairs[(layer, proj)] = (a_key, b_key)
    return AdapterFiles(r, scaling, file, pairs, raw_config)
