"""Build a model for a checkpoint directory and fill its weights.

Life cycle: `load_model(dir, dtype, device)` reads the config (untied where it
ties the LM head over a checkpoint holding a different one, as transformers reads
it), picks the architecture class, allocates the parameters directly in the target dtype on
the target device, streams the checkpoint tensors into them, and checks that
every expected tensor arrived. All failures are `ModelLoadError`/`ConfigError`
naming the file or tensor.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.errors import ConfigError, ModelLoadError
from edgecore.shared.node.malloc import retain_freed_memory
from edgecore.shared.models.registry import ARCHITECTURES
from edgecore.shared.models.weights import iter_weights

if TYPE_CHECKING:
    from edgecore.shared.models.layers import WeightSource
    from edgecore.shared.models.llama import LlamaForCausalLM

log = logging.getLogger("edgecore.models")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype | None, device: str) -> torch.dtype:
    """`auto` is float32 on CPU (exact against references) and bfloat16 on accelerators."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if name not in DTYPES:
        raise ConfigError(f"unsupported dtype '{name}' (choose one of bf16, fp16, fp32, auto)")
    return DTYPES[name]


def build_model(config: ModelConfig, dtype: torch.dtype, device: str, layers: range | None = None
                ) -> LlamaForCausalLM:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = ARCHITECTURES[config.architecture].model_class()(config, layers)
    finally:
        torch.set_default_dtype(previous)
    # RoPE tables stay float32 whatever the weights' dtype.
    model.rope_cos.data = model.rope_cos.data.float()
    model.rope_sin.data = model.rope_sin.data.float()
    return model.eval()


def load_model(model_dir: str | Path, dtype: str | torch.dtype | None = "auto", device: str = "cpu",
               layers: range | None = None, config: ModelConfig | None = None,
               quantize: str | None = None) -> LlamaForCausalLM:
    """`model_dir` may name a `.gguf` file (quant_loader.py); `quantize` ("int8", "int4") quantizes the float
    projections once loaded (`--quantize`)."""
    from edgecore.shared.models.gguf_file import is_gguf
    if is_gguf(model_dir) or quantize:
        from edgecore.shared.models.quant_loader import load_gguf_model, quantize_model
        if is_gguf(model_dir):
            if str(device).startswith("cpu"):
                retain_freed_memory()
            model = load_gguf_model(model_dir, resolve_dtype(dtype, device), device, layers, config)
        else:
            model = load_model(model_dir, dtype, device, layers, config)
        if quantize:
            quantize_model(model, quantize)
        return model
    config = _tied_as_transformers_ties(model_dir, config or ModelConfig.from_dir(model_dir))
    if str(device).startswith("cpu"):
        retain_freed_memory()     # as a CPU ModelRunner would: loading's temporary buffers reuse heap pages
    model = build_model(config, resolve_dtype(dtype, device), device, layers)
    try:
        from edgecore.shared.pack import is_packed
        seen: list[str] = []
        weights = _named(_text_weights(iter_weights(model_dir), ARCHITECTURES[config.architecture].text_prefix), seen)
        used = model.load_weights(weights, threads=2 if is_packed(model_dir) else 0)
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from None
    missing = model.expected_weights() - used
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks tensor(s) {', '.join(sorted(missing)[:5])}")
    unused = [n for n in seen if n not in used and not model.skips(n)]
    if unused:      # transformers warns likewise: a config that disagrees with its checkpoint shows up here
        log.warning("%s: %d checkpoint tensor(s) match nothing in %s and are ignored: %s", model_dir, len(unused),
                    config.architecture, ", ".join(unused[:5]) + (" …" if len(unused) > 5 else ""))
    return model


def _tied_as_transformers_ties(model_dir: str | Path, config: ModelConfig) -> ModelConfig:
    """`config`, untied when config.json says `tie_word_embeddings` but the checkpoint holds an LM head of
    its own that differs from the embedding table: transformers then keeps that head (a tied model would drop it
    and answer differently). Reads the two tensors only in that case."""
    if not config.tie_word_embeddings:
        return config
    found: dict[str, WeightSource] = {}
    for name, source in _text_weights(iter_weights(model_dir), ARCHITECTURES[config.architecture].text_prefix):
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            found[name] = source
    head, embed = found.get("lm_head.weight"), found.get("model.embed_tokens.weight")
    if head is None or (embed is not None and torch.equal(head[:], embed[:])):
        return config
    log.warning("%s: config.json ties the LM head to the embeddings, but the checkpoint has a head of its own "
                "that differs: served with that head, as transformers does", model_dir)
    return dataclasses.replace(config, tie_word_embeddings=False)


def _named(weights: Iterable[tuple[str, WeightSource]], seen: list[str]) -> Iterator[tuple[str, WeightSource]]:
    for name, source in weights:
        seen.append(name)
        yield name, source


def _text_weights(weights: Iterable[tuple[str, WeightSource]], prefix: str) -> Iterator[tuple[str, WeightSource]]:
    """A multimodal checkpoint's text model: names under `prefix`, without it (other towers skipped)."""
    if not prefix:
        yield from weights
        return
    for name, source in weights:
        if name.startswith(prefix):
            yield name[len(prefix):], source
