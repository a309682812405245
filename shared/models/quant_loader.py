"""Models with quantized weights: built from a GGUF file, or an HF checkpoint quantized at load (`--quantize`).

Life cycle: `load_gguf_model(path, dtype, device)` opens and checks the file (`GGUFFile`: a bad file fails
here, before anything is built), builds the model from the file's config, and streams the tensors in: float
tensors (F32/F16/BF16, every norm) through the model's own `load_weights` into its float parameters;
quantized projections (attention q/k/v/o, MLP gate/up/down, the LM head) straight from their blocks into
`QuantWeight`s (quant.py) that the projections multiply by (`_Matmul.set_quant`), merged per projection
(q+k+v, gate+up) and never dequantized whole. A quantized embedding table stays in its blocks too: each
lookup decodes the rows it reads (`VocabParallelEmbedding.quant_rows`); a tied LM head multiplies by the
same blocks repacked for its kernel.
Each load logs what was repacked into which kernel, the quantized bytes, and the file's tensor bytes.

`quantize_model(model, "int8" | "int4")` (`--quantize`) replaces every float projection of a loaded model
(the LM head included; not the embedding) with its quantized form through the same kernels.

Quantized models run through the model's own forward: `FlatDecoder` and `CompiledDecoder` (the fast
float32 decode paths) see no packed float weights and are skipped for them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from edgecore.shared.errors import ConfigError, ModelLoadError
from edgecore.shared.models.gguf_file import GGUFFile, GGUFTensor
from edgecore.shared.models.quant import QuantStack, QuantWeight, Scheme
from edgecore.shared.models.parallel import tensor_parallel

if TYPE_CHECKING:
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.models.layers import WeightSource, _Matmul
    from edgecore.shared.models.llama import LlamaForCausalLM

log = logging.getLogger("edgecore.models")

QUANTIZE = ("int8", "int4")
# Checkpoint projection → the model's module holding it and its place among the module's parts.
_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _projection(model: LlamaForCausalLM, hf: str) -> tuple[str, int] | None:
    """(module path in this process, part index) of a quantized checkpoint weight; None: not a projection
    of this process (another pipeline stage's layer, or not a matmul)."""
    if hf == "lm_head.weight":
        return "lm_head", 0
    parts = hf.split(".")
    if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        return None
    layer = int(parts[2])
    if layer not in model.model.layer_ids:
        return None
    local = model.model.layer_ids.index(layer)
    module, index = _PARTS.get(parts[4], (parts[4], 0))
    return f"model.layers.{local}.{parts[3]}.{module}", index


def load_gguf_model(path: str | Path, dtype: torch.dtype, device: str, layers: range | None = None,
                    config: ModelConfig | None = None) -> LlamaForCausalLM:
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.models.loader import build_model
    if not str(device).startswith("cpu"):
        raise ConfigError(f"GGUF models run on CPU (their quantized kernels are torch's CPU ones), not '{device}'")
    if tensor_parallel().size != 1:
        raise ConfigError("a GGUF model loads on one rank: tensor parallelism is not supported for it")
    gguf = GGUFFile(path)
    config = config or ModelConfig.from_dict(gguf.hf_config(), source=str(path))
    model = build_model(config, dtype, device, layers)
    quantized: dict[str, dict[int, QuantWeight]] = {}
    used: set[str] = set()
    embedding: GGUFTensor | None = None

    def floats() -> Iterator[tuple[str, WeightSource]]:
        nonlocal embedding
        for t in gguf.tensors():
            target = _projection(model, t.hf_name) if t.quantized else None
            if t.hf_name == "model.embed_tokens.weight" and t.quantized:
                embedding = t           # kept as blocks, rows decoded per lookup
                used.add(t.hf_name)
                continue
            if target is not None:
                module, index = target
                try:
                    quantized.setdefault(module, {})[index] = QuantWeight.from_blocks(t.kind, t.raw, *t.shape)
                except ValueError as exc:
                    raise ModelLoadError(f"{path}: tensor '{t.name}': {exc}") from None
                used.add(t.hf_name)
            elif t.quantized and t.hf_name.startswith("model.layers.") and model.skips(t.hf_name):
                continue            # another pipeline stage's quantized layer: not even decoded
            else:
                yield t.hf_name, t.floats().to(dtype)

    try:
        used |= model.load_weights(floats())
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    if embedding is not None:
        embed = model.model.embed_tokens
        embed.quant_rows = (embedding.kind, embedding.raw.clone())
        embed.weight = nn.Parameter(embed.weight.detach().new_empty(0), requires_grad=False)
        log.info("%s: embedding table kept as %s blocks (%.1f MB), rows decoded per lookup", path, embedding.kind,
                 embedding.raw.numel() / 1e6)
        if config.tie_word_embeddings:
            quantized["lm_head"] = {0: QuantWeight.from_blocks(embedding.kind, embedding.raw, *embedding.shape)}
    missing = model.expected_weights() - used
    if missing:
        raise ModelLoadError(f"{path}: the file lacks tensor(s) {', '.join(sorted(missing)[:5])} "
                             "(Hugging Face names)")
    unknown = gguf.unknown()
    if unknown:
        log.warning("%s: %d tensor(s) match nothing in %s and are ignored: %s", path, len(unknown),
                    config.architecture, ", ".join(unknown[:5]))
    _install(model, quantized, str(path), tied=config.tie_word_embeddings and embedding is None)
    log.info("%s: GGUF %s, tensors %.1f MB in the file", path, gguf.arch, gguf.tensor_bytes() / 1e6)
    return model


def _install(model: LlamaForCausalLM, quantized: dict[str, dict[int, QuantWeight]], what: str, tied: bool,
             by_part: bool = True) -> None:
    """Set each module's quantized weight (its parts in order; `by_part`: one per checkpoint tensor, so q/k/v
    and gate/up must all be there) and log what went to which kernel."""
    counts: dict[str, list[int]] = {}
    for name, parts in quantized.items():
        module = cast("_Matmul", model.get_submodule(name))
        ordered = [parts[i] for i in sorted(parts)]
        if by_part and (sorted(parts) != list(range(len(parts))) or (name.endswith("qkv_proj") and len(parts) != 3)
                        or (name.endswith("gate_up_proj") and len(parts) != 2)):
            raise ModelLoadError(f"{what}: {name} has quantized parts {sorted(parts)} only: a merged projection "
                                 "needs all its parts quantized (mixed float and quantized parts are not supported)")
        weight = QuantStack.of(ordered)
        weight.pack()           # int4 parts merged as nibbles: packed once, before any matmul
        try:
            module.set_quant(weight, keep_plain=tied and name == "lm_head")
        except ValueError as exc:
            raise ModelLoadError(f"{what}: {name}: {exc}") from None
        for p in ordered:
            c = counts.setdefault(f"{p.source}→{p.scheme}", [0, 0, 0])
            c[0] += 1
            c[1] += p.nbytes
            c[2] = max(c[2], int(p.requant_error * 1e6))
    for kind, (n, nbytes, err) in sorted(counts.items()):
        note = f", requantized per row (largest weight change {err / 1e6:.3g})" if err else ""
        log.info("%s: %d weight(s) %s, %.1f MB packed%s", what, n, kind, nbytes / 1e6, note)


def quantize_model(model: LlamaForCausalLM, scheme: str) -> int:
    """`--quantize`: every float projection (and the LM head) → int8 per row or int4 per 32 inputs.
    Returns how many were quantized; a projection int4 cannot hold (widths) becomes int8, said in the log."""
    from edgecore.shared.models.layers import _Matmul
    if scheme not in QUANTIZE:
        raise ConfigError(f"--quantize '{scheme}' is not supported (choose {' or '.join(QUANTIZE)})")
    if tensor_parallel().size != 1:
        raise ConfigError("--quantize runs on one rank: tensor parallelism is not supported with it")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError(f"--quantize runs on CPU (its int8/int4 kernels are torch's CPU ones), not '{device}'")
    done: dict[str, dict[int, QuantWeight]] = {}
    fallback = []
    for name, module in model.named_modules():
        if not isinstance(module, _Matmul) or module.quant is not None or module.weight.dim() != 2:
            continue
        try:
            weight = QuantWeight.from_float(module.weight, cast(Scheme, scheme))
        except ValueError:
            weight = QuantWeight.from_float(module.weight, "int8")
            fallback.append(name)
        weight.source = str(module.weight.dtype).removeprefix("torch.")
        done[name] = {0: weight}
    if fallback:
        log.warning("--quantize int4: %d projection(s) have widths the int4 kernel cannot take and are int8: %s",
                    len(fallback), ", ".join(fallback[:3]))
    _install(model, done, f"--quantize {scheme}", tied=model.config.tie_word_embeddings, by_part=False)
    return len(done)
