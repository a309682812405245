"""GGUF checkpoints (llama.cpp's single-file format): metadata → the model config, tensors → checkpoint names.

Life cycle: `GGUFFile(path)` memory-maps the file with the `gguf` package's reader (copy-on-write: the file
is never written) and checks it whole before anything is built: every tensor's type is one this runtime
decodes, its bytes lie inside the file, and its shape is the one the metadata implies. Any failure is one
`ModelLoadError` naming the file and the tensor or key. Then `hf_config()` gives the model's config.json as
transformers would read it (`ModelConfig.from_dir` takes it when `--model` names a `.gguf` file), and
`tensors()` yields each tensor under its Hugging Face name with its raw bytes (a view of the map) and type;
for the llama architecture the rows of Q and K are put back in Hugging Face's order (llama.cpp's converter
interleaves each head's two rotary halves: `convert_hf_to_gguf.py`'s `permute`).

Supported: architectures `llama` and `qwen2` (Mistral files converted by llama.cpp are `llama`); tensor types
F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K (shared/models/quant.py). Not supported (refused with a one-line
error): Llama 3.1-style RoPE frequency factors (`rope_freqs`), per-layer head counts, other quant types.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgecore.shared.errors import ModelLoadError
from edgecore.shared.models.quant import BLOCKS

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
PERMUTED_QK = {"llama"}        # architectures whose converter interleaves Q/K rows for llama.cpp's RoPE

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def is_gguf(path: str | Path) -> bool:
    """Whether `--model` names a GGUF file (by its suffix; the contents are checked on opening)."""
    return str(path).endswith(".gguf")


def hf_name(name: str) -> str | None:
    """A GGUF tensor name → its Hugging Face checkpoint name (None: no Llama-family parameter)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


@dataclass(frozen=True)
class GGUFTensor:
    name: str                   # the GGUF name
    hf_name: str
    kind: str                   # F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K
    shape: tuple[int, ...]      # torch order: [rows, cols] ([out, in] for a projection)
    raw: torch.Tensor           # uint8 [rows, bytes per row] (1-D tensors: [bytes]), in Hugging Face row order

    @property
    def quantized(self) -> bool:
        return self.kind not in ("F32", "F16", "BF16")

    def floats(self) -> torch.Tensor:
        """The tensor as float32 in its shape (for small tensors and float types: a quantized projection is
        never read this way when serving; the embedding table is)."""
        from edgecore.shared.models.quant import dequantize
        return dequantize(self.kind, self.raw).reshape(self.shape)


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file {self.path} does not exist")
        try:
            self.reader = _checked_reader()(self.path, "c")
        except _BadTensor as exc:
            raise ModelLoadError(f"{self.path}: {exc}") from None
        except Exception as exc:          # the reader raises ValueError, struct/numpy errors on bad bytes
            raise ModelLoadError(f"{self.path}: not a readable GGUF file (truncated or corrupted?): "
                                 f"{type(exc).__name__}: {exc}") from None
        self.meta: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            try:
                self.meta[key] = field.contents()
            except Exception as exc:
                raise ModelLoadError(f"{self.path}: metadata key '{key}' is corrupt: {exc}") from None
        self.arch = str(self.meta.get("general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"{self.path}: general.architecture '{self.arch}' is not supported "
                                 f"(supported: {', '.join(ARCHITECTURES)})")
        self.config = self._config()
        self._check_tensors()

    # ---- metadata ------------------------------------------------------------------------------
    def _key(self, name: str, default: Any = None, required: bool = False) -> Any:
        key = f"{self.arch}.{name}"
        if key not in self.meta:
            if required:
                raise ModelLoadError(f"{self.path}: metadata lacks '{key}'")
            return default
        value = self.meta[key]
        if isinstance(value, list):
            raise ModelLoadError(f"{self.path}: metadata '{key}' is per layer ({value[:4]}…): not supported")
        return value

    def _config(self) -> dict[str, Any]:
        """config.json as transformers would have written it for this file."""
        hidden = int(self._key("embedding_length", required=True))
        heads = int(self._key("attention.head_count", required=True))
        head_dim = int(self._key("attention.key_length", hidden // heads))
        rot = self._key("rope.dimension_count")
        if rot is not None and int(rot) != head_dim:
            raise ModelLoadError(f"{self.path}: {self.arch}.rope.dimension_count = {rot}, but partial rotary "
                                 f"embeddings (head size {head_dim}) are not supported")
        tokens = self.meta.get("tokenizer.ggml.tokens")
        embd = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        vocab = self._key("vocab_size") or (len(tokens) if tokens else None) or \
            (int(embd.shape[1]) if embd is not None else None)
        if not vocab:
            raise ModelLoadError(f"{self.path}: neither metadata nor token_embd.weight gives the vocabulary size")
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]], "model_type": self.arch,
            "hidden_size": hidden, "intermediate_size": int(self._key("feed_forward_length", required=True)),
            "num_hidden_layers": int(self._key("block_count", required=True)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._key("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "max_position_embeddings": int(self._key("context_length", required=True)),
            "rms_norm_eps": float(self._key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._key("rope.freq_base", 10000.0)),
            "vocab_size": int(vocab), "hidden_act": "silu",
            "tie_word_embeddings": not any(t.name == "output.weight" for t in self.reader.tensors),
            "torch_dtype": "float32",
        }
        scaling = str(self._key("rope.scaling.type", "none"))
        factor = self._key("rope.scaling.factor")
        if scaling == "linear" and factor:
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        elif scaling == "yarn" and factor:
            config["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings":
                                      int(self._key("rope.scaling.original_context_length", config[
                                          "max_position_embeddings"]))}
        elif scaling not in ("none", "linear", "yarn"):
            raise ModelLoadError(f"{self.path}: {self.arch}.rope.scaling.type '{scaling}' is not supported")
        for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
            if key in self.meta:
                config[hf] = int(self.meta[key])
        if self.arch == "llama":
            config["attention_bias"] = any(t.name.endswith("attn_q.bias") for t in self.reader.tensors)
        return config

    def hf_config(self) -> dict[str, Any]:
        return dict(self.config)

    # ---- tensors -------------------------------------------------------------------------------
    def _expected_shape(self, hf: str) -> tuple[int, ...] | None:
        c = self.config
        hidden, d = c["hidden_size"], c["head_dim"]
        q, kv, inter = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
        last = hf.rsplit(".", 2)
        part, bias = last[-2], last[-1] == "bias"
        table = {"embed_tokens": (c["vocab_size"], hidden), "lm_head": (c["vocab_size"], hidden),
                 "norm": (hidden,), "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
                 "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
                 "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        shape = table.get(part)
        return shape[:1] if shape is not None and bias else shape

    def _check_tensors(self) -> None:
        size = len(self.reader.data)
        layers = self.config["num_hidden_layers"]
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if t.name == "rope_freqs.weight":
                raise ModelLoadError(f"{self.path}: tensor 'rope_freqs.weight' (Llama 3.1-style RoPE frequency "
                                     "factors) is not supported")
            if kind not in BLOCKS:
                raise ModelLoadError(f"{self.path}: tensor '{t.name}' has type {kind}, which is not supported "
                                     f"(supported: {', '.join(BLOCKS)})")
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            per, nbytes = BLOCKS[kind]
            if shape[-1] % per:
                raise ModelLoadError(f"{self.path}: tensor '{t.name}' has {shape[-1]} columns, not whole {kind} "
                                     f"blocks of {per}")
            want = int(np.prod(shape)) // per * nbytes
            if t.data_offset + want > size or t.n_bytes != want or t.data.nbytes != want:
                raise ModelLoadError(f"{self.path}: tensor '{t.name}' needs {want} bytes at offset {t.data_offset}, "
                                     f"but the file has {max(0, size - t.data_offset)} there (truncated?)")
            hf = hf_name(t.name)
            if hf is None:
                continue
            m = _LAYER.match(t.name)
            if m and int(m.group(1)) >= layers:
                raise ModelLoadError(f"{self.path}: tensor '{t.name}' is beyond {self.arch}.block_count = {layers}")
            expected = self._expected_shape(hf)
            if expected is not None and shape != expected:
                raise ModelLoadError(f"{self.path}: tensor '{t.name}' has shape {list(shape)}, but the metadata "
                                     f"implies {list(expected)}")

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every Llama-family tensor under its Hugging Face name, raw bytes in Hugging Face row order; tensors
        with no such name are skipped (`unknown()` lists them)."""
        c = self.config
        for t in self.reader.tensors:
            hf = hf_name(t.name)
            if hf is None:
                continue
            kind = t.tensor_type.name
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            raw = torch.from_numpy(np.asarray(t.data).reshape(-1).view(np.uint8))
            if len(shape) == 2:
                raw = raw.view(shape[0], -1)
                if self.arch in PERMUTED_QK and (hf.endswith("q_proj.weight") or hf.endswith("k_proj.weight")):
                    heads = c["num_attention_heads"] if "q_proj" in hf else c["num_key_value_heads"]
                    raw = _unpermute(raw, heads)
            elif self.arch in PERMUTED_QK and (hf.endswith("q_proj.bias") or hf.endswith("k_proj.bias")):
                heads = c["num_attention_heads"] if "q_proj" in hf else c["num_key_value_heads"]
                raw = _unpermute(raw.view(shape[0], -1), heads).reshape(-1)
            yield GGUFTensor(t.name, hf, kind, shape, raw)

    def index(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(GGUF name, type, shape in torch order) of every tensor, from the header alone."""
        return [(t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape.tolist())))
                for t in self.reader.tensors]

    def unknown(self) -> list[str]:
        return [t.name for t in self.reader.tensors if hf_name(t.name) is None]

    def tensor_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors)


class _BadTensor(Exception):
    """A tensor the file cannot hold (found while the reader lays out its tensors)."""


_READER: Any = None


def _checked_reader() -> Any:
    """`gguf.GGUFReader`, checking each tensor's type and extent before laying it out: a truncated file then
    names the first tensor that does not fit, not a numpy reshape."""
    global _READER
    if _READER is None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

        class CheckedReader(GGUFReader):
            def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
                for field in fields:
                    _, name_data, _, dims, raw_dtype, offset = field.parts
                    name = bytes(name_data).decode("utf-8", "replace")
                    try:
                        kind = GGMLQuantizationType(int(raw_dtype[0]))
                    except ValueError:
                        raise _BadTensor(f"tensor '{name}' has unknown type id {int(raw_dtype[0])}") from None
                    per, size = GGML_QUANT_SIZES[kind]
                    need, at = int(np.prod(dims)) * size // per, int(start_offs + offset[0])
                    if at + need > len(self.data):
                        raise _BadTensor(f"tensor '{name}' needs {need} bytes at offset {at}, but the file has "
                                         f"{max(0, len(self.data) - at)} there (truncated?)")
                super()._build_tensors(start_offs, fields)

        _READER = CheckedReader
    return _READER


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, GGUF holds rows (0, d/2, 1, d/2 + 1, …); Hugging Face
    holds the first rotary half, then the second."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)
