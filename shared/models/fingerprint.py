"""Model fingerprint: what two peers must agree on before exchanging KV.

A SHA-256 over the canonical config (the fields that shape KV and logits),
the tokenizer file, and every weight's name, dtype and shape (read from
safetensors headers only; for a GGUF file, its tokenizer metadata and its tensors' names, types and
shapes from its header). Weights' values are not hashed (too slow for
large models); a retrained checkpoint of identical shapes should change its
config or tokenizer, or be deployed under a different model name.

`--quantize` (weights quantized at load) is not part of it: an edge and a core agree on a model whatever
either quantizes (a quantized edge decoding from a float core's KV is the intended mixed deployment; its
KV stays close, not identical). The disk KV tier is a cache, which must return what this engine would
compute: its key takes the quantize mode as well (`with_quantize`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.weights import weight_index


def model_fingerprint(model_dir: str | Path, config: ModelConfig | None = None) -> str:
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_dir(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    if str(model_dir).endswith(".gguf"):      # a GGUF file: its tokenizer metadata, tensor names, types, shapes
        from edgecore.shared.models.gguf_file import GGUFFile
        gguf = GGUFFile(model_dir)
        h.update(json.dumps({k: v for k, v in gguf.meta.items() if k.startswith("tokenizer.")}, sort_keys=True,
                            default=str).encode())
        for name, kind, shape in sorted(gguf.index()):
            h.update(f"{name}:{kind}:{shape};".encode())
        return h.hexdigest()
    tok = model_dir / "tokenizer.json"
    h.update(hashlib.sha256(tok.read_bytes()).digest() if tok.is_file() else b"no-tokenizer")
    for name, (dtype, shape) in sorted(weight_index(model_dir).items()):
        h.update(f"{name}:{dtype}:{shape};".encode())
    return h.hexdigest()


def with_quantize(fingerprint: str, quantize: str | None, kv_dtype: str | None = None) -> str:
    """A fingerprint that also tells `--quantize` and `--kv-cache-dtype` modes apart (the disk KV tier's: its
    blocks hold the KV those modes computed); unchanged without them."""
    out = fingerprint if not quantize else f"{fingerprint}+quantize={quantize}"
    return out if not kv_dtype else f"{out}+kv={kv_dtype}"
