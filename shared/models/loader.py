"""Build a model for a checkpoint directory and fill its weights.

Life cycle: `load_model(dir, dtype, device)` reads the config, picks the
architecture class, allocates the parameters directly in the target dtype on
the target device, streams the checkpoint tensors into them, and checks that
every expected tensor arrived. All failures are `ModelLoadError`/`ConfigError`
naming the file or tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from edgecore.shared.config import ModelConfig
from edgecore.shared.errors import ConfigError, ModelLoadError
from edgecore.shared.malloc import retain_freed_memory
from edgecore.shared.models.deepseek import DeepseekForCausalLM
from edgecore.shared.models.llama import LlamaForCausalLM
from edgecore.shared.weights import iter_weights

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
}


def resolve_dtype(name: str | torch.dtype | None, device: str) -> torch.dtype:
    """`auto` is float32 on CPU (exact against references) and bfloat16 on accelerators."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if name not in DTYPES:
        raise ConfigError(f"unsupported dtype '{name}' (choose one of bf16, fp16, fp32, auto)")
    return DTYPES[name]


def build_model(config: ModelConfig, dtype: torch.dtype, device: str, layers: range | None = None):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = ARCHITECTURES[config.architecture](config, layers)
    finally:
        torch.set_default_dtype(previous)
    # RoPE tables stay float32 whatever the weights' dtype.
    model.rope_cos.data = model.rope_cos.data.float()
    model.rope_sin.data = model.rope_sin.data.float()
    return model.eval()


def load_model(model_dir: str | Path, dtype="auto", device: str = "cpu",
               layers: range | None = None, config: ModelConfig | None = None):
    config = config or ModelConfig.from_dir(model_dir)
    if str(device).startswith("cpu"):
        retain_freed_memory()     # as a CPU ModelRunner would: loading's temporary buffers reuse heap pages
    model = build_model(config, resolve_dtype(dtype, device), device, layers)
    try:
        from edgecore.shared.pack import is_packed
        used = model.load_weights(iter_weights(model_dir), threads=2 if is_packed(model_dir) else 0)
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from None
    missing = model.expected_weights() - used
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks tensor(s) {', '.join(sorted(missing)[:5])}")
    return model
