"""Reading packed checkpoints: tensors for the model loader, byte-identical unpack.

Life cycle: `PackedCheckpoint(dir)` validates the manifest (plain file names;
each tensor's dtype, shape and byte range as the original header it stores says,
so a corrupt manifest cannot load bytes as another dtype) and memory-maps the
pack file. `lazy()` yields (name, PackedTensor) in file order: each decodes on
slicing, or straight into a destination as per-chunk jobs (`decode_jobs`)
that the model loader spreads over a thread pool;
`unpack(out)` rewrites every original shard (exact header bytes, then the tensors' bytes in offset order)
and checks its SHA-256. Every chunk's CRC-32 is checked after decoding it; a
mismatch or a malformed blob raises `ModelLoadError` naming the tensor.
"""

from __future__ import annotations

import base64
import json
import mmap
import shutil
import struct
import threading
import zlib
from functools import partial
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
import zstandard

from edgecore.protocol.codecs.base import zstd_frame_fits
from edgecore.protocol.codecs.planes import join_top_byte
from edgecore.shared.errors import ModelLoadError
from edgecore.shared.pack.format import (BITS, FORMAT, MAGIC, MANIFEST, NUMPY, PACK_FILE, VERSION, plain_name,
                                        sha256_file)

if TYPE_CHECKING:
    from edgecore.shared.models.weights import SliceIndex

_FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class PackedCheckpoint:
    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        try:
            self.manifest = json.loads((self.dir / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{self.dir / MANIFEST} is unreadable: {exc}") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT \
                or self.manifest.get("version") != VERSION:
            found = self.manifest if isinstance(self.manifest, dict) else {}
            raise ModelLoadError(f"{self.dir} holds an unsupported pack format "
                                 f"{found.get('format')} v{found.get('version')}")
        try:
            self._check_manifest()
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ModelLoadError(f"{self.dir / MANIFEST} is malformed: {type(exc).__name__}: {exc}") from None
        path = self.dir / PACK_FILE
        try:
            self._file = open(path, "rb")
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from None
        if hasattr(mmap, "MADV_WILLNEED"):
            self._map.madvise(mmap.MADV_WILLNEED)    # start reading ahead while the first tensors decode
        if self._map[:8] != MAGIC or struct.unpack_from("<I", self._map, 8)[0] != VERSION:
            raise ModelLoadError(f"{path} is not an edgecore pack file")
        self.tensors = self.manifest["tensors"]

    def _check_manifest(self) -> None:
        m = self.manifest
        headers = []
        for shard in m["shards"]:
            if not plain_name(shard["file"]):
                raise ModelLoadError(f"{self.dir / MANIFEST} names an unsafe shard file {shard['file']!r}")
            headers.append(json.loads(base64.b64decode(shard["header"], validate=True)))
        for name in m["files"]:
            if not plain_name(name):
                raise ModelLoadError(f"{self.dir / MANIFEST} names an unsafe file {name!r}")
        for t in m["tensors"]:
            shard = t["shard"]
            if not isinstance(shard, int) or not 0 <= shard < len(headers):
                raise ValueError(f"tensor {t['name']!r} names shard {shard!r}")
            original = headers[shard][t["name"]]
            if (t["dtype"], list(t["shape"]), [t["begin"], t["end"]]) != \
                    (original["dtype"], list(original["shape"]), list(original["data_offsets"])):
                raise ModelLoadError(f"packed tensor '{t['name']}': the manifest's dtype, shape or byte range "
                                     "differs from the original header it stores (corrupt manifest)")
            if not all(isinstance(t[k], int) and t[k] >= 0 for k in ("offset", "length")):
                raise ValueError(f"tensor {t['name']!r} has a bad offset or length")
            if not (isinstance(t.get("crc32"), int) if t["encoding"] == "raw" else isinstance(t.get("chunks"), list)):
                raise ValueError(f"tensor {t['name']!r} has no checksums")

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass    # a view is still alive (e.g. held by a traceback); the map closes when it dies
        self._file.close()

    def index(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {t["name"]: (t["dtype"], tuple(t["shape"])) for t in self.tensors}

    def _blob(self, entry: dict) -> memoryview:
        start, length = entry["offset"], entry["length"]
        if start + length > len(self._map):
            raise ModelLoadError(f"packed tensor '{entry['name']}' is truncated (pack file too short)")
        return memoryview(self._map)[start:start + length]

    def chunk_jobs(self, entry: dict, out: np.ndarray) -> list[Callable[[], None]]:
        """One callable per chunk of a `planes` tensor, each decoding its chunk into `out` (a flat array
        of the tensor's bit container) and checking its CRC-32; they may run in any order, on any thread."""
        name, blob = entry["name"], self._blob(entry)
        count, rest_size = len(out), out.dtype.itemsize - 1
        try:
            per_chunk, chunks = int(self.manifest["chunk_values"]), entry["chunks"]
            valid = (per_chunk > 0 and len(chunks) == -(-count // per_chunk)
                     and out.nbytes == entry["end"] - entry["begin"]
                     and sum(int(c[0]) for c in chunks) + count * rest_size == len(blob))
        except (KeyError, TypeError, ValueError, IndexError):
            valid = False
        if not valid:
            raise ModelLoadError(f"packed tensor '{name}' is corrupt: its chunks do not match its size")
        jobs: list[Callable[[], None]] = []
        pos = 0
        for i, (frame_len, crc) in enumerate(chunks):
            n = min(per_chunk, count - i * per_chunk)
            frame = blob[pos:pos + frame_len]
            rest = blob[pos + frame_len:pos + frame_len + n * rest_size]
            jobs.append(partial(_decode_chunk, name, frame, rest, out[i * per_chunk:i * per_chunk + n], crc))
            pos += frame_len + n * rest_size
        return jobs

    def tensor_bytes(self, entry: dict, out: np.ndarray | None = None) -> bytes | memoryview:
        """The original bytes of one tensor, checksum verified (decoded into `out`, a flat array of the
        tensor's bit container, when given)."""
        name, size = entry["name"], entry["end"] - entry["begin"]
        if entry["encoding"] == "raw":
            data = self._blob(entry)
            if len(data) != size or (zlib.crc32(data) & 0xFFFFFFFF) != entry["crc32"]:
                raise ModelLoadError(f"packed tensor '{name}' failed its checksum (corrupt pack)")
            return data
        if entry["encoding"] != "planes" or entry["dtype"] not in BITS:
            raise ModelLoadError(f"packed tensor '{name}' is corrupt: unknown encoding "
                                 f"{entry['encoding']!r} for {entry['dtype']}")
        container = np.dtype(BITS[entry["dtype"]])
        if out is None:
            out = np.empty(size // container.itemsize, dtype=container)
        for job in self.chunk_jobs(entry, out):
            job()
        return memoryview(out).cast("B")  # type: ignore[arg-type]  # numpy types ndarray.__buffer__ for 3.12+ only

    def tensor(self, entry: dict) -> torch.Tensor:
        data = self.tensor_bytes(entry)
        dtype = entry["dtype"]
        if dtype not in NUMPY:
            raise ModelLoadError(f"packed tensor '{entry['name']}' has unsupported dtype {dtype}")
        arr: np.ndarray = np.frombuffer(data, dtype=NUMPY[dtype]).copy() if entry["encoding"] == "raw" \
            else np.frombuffer(data, dtype=NUMPY[dtype])
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if dtype == "BF16" else torch.from_numpy(arr)
        if dtype in _FP8:
            t = t.view(_FP8[dtype])
        try:
            return t.reshape(entry["shape"])
        except RuntimeError as exc:
            raise ModelLoadError(f"packed tensor '{entry['name']}' does not fit its shape: {exc}") from None

    def lazy(self) -> Iterator[tuple[str, PackedTensor]]:
        """(name, lazy tensor) pairs: a loader can decode each straight into its parameter."""
        for entry in self.tensors:
            yield entry["name"], PackedTensor(self, entry)

    def unpack(self, out: str | Path, progress: Callable[[str], None] | None = None) -> None:
        out = Path(out)
        if out.resolve() == self.dir.resolve():
            raise ModelLoadError("the output directory must differ from the packed directory")
        out.mkdir(parents=True, exist_ok=True)
        by_shard: dict[int, list[dict]] = {}
        for entry in self.tensors:
            by_shard.setdefault(entry["shard"], []).append(entry)
        for index, shard in enumerate(self.manifest["shards"]):
            path, final = out / (shard["file"] + ".partial"), out / shard["file"]
            header = base64.b64decode(shard["header"])
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(header)) + header)
                pos = 0
                for entry in sorted(by_shard.get(index, []), key=lambda e: e["begin"]):
                    if entry["begin"] != pos:
                        raise ModelLoadError(f"pack manifest leaves a gap before tensor '{entry['name']}'")
                    f.write(self.tensor_bytes(entry))
                    pos = entry["end"]
                    if progress:
                        progress(f"{shard['file']}: {entry['name']}")
            if sha256_file(path) != shard["sha256"]:
                path.unlink()
                raise ModelLoadError(f"unpacked {shard['file']} differs from the original (checksum)")
            path.rename(final)              # only a verified shard takes its name
        for name in self.manifest["files"]:
            if name != PACK_FILE and (self.dir / name).is_file():
                shutil.copyfile(self.dir / name, out / name)


class PackedTensor:
    """A packed tensor not yet decoded: shape, slicing (decodes), or `decode_jobs` into a destination."""

    def __init__(self, checkpoint: PackedCheckpoint, entry: dict) -> None:
        self.checkpoint, self.entry = checkpoint, entry
        self.shape = tuple(entry["shape"])

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def get_dtype(self) -> str:
        """The safetensors dtype name, as a safetensors slice reports it (fp8 loading asks)."""
        return self.entry["dtype"]

    def __getitem__(self, item: SliceIndex) -> torch.Tensor:
        return self.checkpoint.tensor(self.entry)[item]

    def _bits_of(self, dest: torch.Tensor) -> np.ndarray | None:
        """`dest`'s bits as a flat numpy array when this tensor can decode straight into it."""
        e = self.entry
        native = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(e["dtype"])
        if (native is None or dest.dtype != native or e["encoding"] != "planes" or not dest.is_contiguous()
                or tuple(dest.shape) != self.shape or dest.device.type != "cpu"):
            return None
        bits = dest.view(torch.int16 if dest.element_size() == 2 else torch.int32).numpy().reshape(-1)
        return bits.view(np.uint16 if dest.element_size() == 2 else np.uint32)

    def decode_jobs(self, dest: torch.Tensor) -> list[Callable[[], None]] | None:
        """Per-chunk jobs decoding into `dest` (same shape and dtype, contiguous), to run on a thread
        pool; None when the caller must read and copy instead (dtype conversion, raw encoding)."""
        bits = self._bits_of(dest)
        return None if bits is None else self.checkpoint.chunk_jobs(self.entry, bits)


_local = threading.local()      # one zstd decompression context per decoding thread


def _decode_chunk(name: str, frame: memoryview, rest: memoryview, out: np.ndarray, crc: int) -> None:
    if not hasattr(_local, "zstd"):
        _local.zstd = zstandard.ZstdDecompressor()
    try:
        zstd_frame_fits(frame, len(out))
        top = _local.zstd.decompress(frame, max_output_size=len(out))
        if len(top) != len(out):
            raise ValueError("chunk size does not match the tensor")
        join_top_byte(top, rest, out)
    except (ValueError, zstandard.ZstdError) as exc:
        raise ModelLoadError(f"packed tensor '{name}' is corrupt: {exc}") from None
    if zlib.crc32(out) & 0xFFFFFFFF != crc:  # type: ignore[arg-type]  # numpy types ndarray.__buffer__ for 3.12+ only
        raise ModelLoadError(f"packed tensor '{name}' failed its checksum (corrupt pack)")
