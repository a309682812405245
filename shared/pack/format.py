"""The packed checkpoint format (version 2).

A packed directory holds:
- `edgecore-pack.json` (the manifest): format name and version, the zstd level,
  each original safetensors shard (file name, its exact header bytes in base64,
  size, SHA-256), each tensor (name, shard, dtype, shape, byte range in the
  shard's data section, offset and length in the pack file, encoding, and the
  CRC-32 of its original bytes — per chunk for `planes`), the chunk size in
  values, and every other file with its size and SHA-256 (for verified
  downloads);
- `model.edgepack`: magic `EDGEPACK`, u32 LE version, then one blob per tensor;
- the model's other files (config, tokenizer, ...) copied unchanged.

Encodings: `planes` — the tensor is cut into chunks of `chunk_values` values;
each chunk's values are split into their top bytes (sign and high exponent
bits: few distinct values) and their other bytes (close to random), see
`split_top_byte` in protocol/codecs/planes.py, and stored as
zstd(top bytes) ‖ other bytes; the manifest lists each chunk's
[zstd frame length, CRC-32]. Chunks let a loader decode one large tensor on
several threads, and join each chunk while it is still in cache. `raw` — the
original bytes (small tensors, integer dtypes, or when planes do not pay off).

Version 1 (whole-tensor planes, rotated exponent split) is no longer read: the
loader names the version and a re-pack (or a fresh download) fixes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

MANIFEST = "edgecore-pack.json"
PACK_FILE = "model.edgepack"
MAGIC = b"EDGEPACK"
VERSION = 2
FORMAT = "edgecore-pack"
MIN_PLANES_BYTES = 4096
CHUNK_VALUES = 1 << 18        # 256 Ki values: a chunk and its output stay in a core's L2

# safetensors dtype → (numpy container of the raw bits, float?)
BITS = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}
# safetensors dtype → numpy dtype read from the bytes (BF16 and FP8 as their bits; the reader views them as torch's)
NUMPY = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
         "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
         "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}


def plain_name(name: object) -> bool:
    """A file name a manifest may use: no directory part, not hidden or special (nothing can land outside
    the directory it is written to or read from)."""
    return (isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and "\0" not in name
            and not name.startswith("."))


def is_packed(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MANIFEST).is_file()


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()
