"""The packed checkpoint format (version 1).

A packed directory holds:
- `edgecore-pack.json` (the manifest): format name and version, the zstd level,
  each original safetensors shard (file name, its exact header bytes in base64,
  size, SHA-256), each tensor (name, shard, dtype, shape, byte range in the
  shard's data section, offset and length in the pack file, encoding, length
  of the entropy-coded exponent plane, CRC-32 of its original bytes), and every
  other file with its size and SHA-256 (for verified downloads);
- `model.edgepack`: magic `EDGEPACK`, u32 LE version, then one blob per tensor;
- the model's other files (config, tokenizer, ...) copied unchanged.

Encodings: `planes` — the values' bits split into exponent and sign+mantissa
planes (protocol/codecs/planes.py), blob = zstd(exponent plane) ‖ sign+mantissa
plane; `raw` — the original bytes (small tensors, integer dtypes, or when
planes do not pay off).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

MANIFEST = "edgecore-pack.json"
PACK_FILE = "model.edgepack"
MAGIC = b"EDGEPACK"
VERSION = 1
FORMAT = "edgecore-pack"
MIN_PLANES_BYTES = 4096

# safetensors dtype → (numpy container of the raw bits, float?)
BITS = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}
NUMPY = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
         "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def is_packed(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MANIFEST).is_file()


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()
