"""`pack_model`: safetensors checkpoint → packed checkpoint.

Life cycle: read each shard's header, memory-map its data; encode tensors in a
thread pool (numpy and zstd release the GIL) and append the blobs in order to
`model.edgepack`; copy the other files; write the manifest last (a directory
without a manifest is not a packed checkpoint, so an interrupted pack is never
loaded). Progress goes to the `progress` callback.
"""

from __future__ import annotations

import base64
import json
import mmap
import shutil
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import zstandard

from protocol.codecs.planes import split_planes
from shared.errors import ModelLoadError
from shared.pack.format import (BITS, FORMAT, MAGIC, MANIFEST, MIN_PLANES_BYTES, PACK_FILE, VERSION,
                                sha256_file)
from shared.weights import checkpoint_files


def read_header(path: Path) -> tuple[bytes, dict, int]:
    """(exact header bytes, parsed header, data section offset) of a safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 1024 * 1024:
            raise ModelLoadError(f"{path} has an implausible header length {n}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} has a corrupt safetensors header: {exc}") from None
    return raw, header, 8 + n


def encode_tensor(data: memoryview, dtype: str, level: int) -> tuple[str, bytes, int]:
    """(encoding, blob, exponent length) for one tensor's raw bytes."""
    container = BITS.get(dtype)
    if container is None or len(data) < MIN_PLANES_BYTES:
        return "raw", bytes(data), 0
    bits = np.frombuffer(data, dtype=container)
    exponent, mantissa = split_planes(bits)
    packed = zstandard.ZstdCompressor(level=level).compress(exponent)
    if len(packed) >= 0.95 * len(exponent):
        return "raw", bytes(data), 0
    return "planes", packed + mantissa.tobytes(), len(packed)


def pack_model(src: str | Path, out: str | Path, level: int = 3, threads: int = 2,
               progress: Callable[[str], None] | None = None) -> dict:
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise ModelLoadError(f"{src} is not a model directory (no config.json)")
    if out.resolve() == src.resolve():
        raise ModelLoadError("the output directory must differ from the model directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    shards, tensors, jobs = [], [], []
    maps = []
    for index, path in enumerate(checkpoint_files(src)):
        raw, header, start = read_header(path)
        shards.append({"file": path.name, "header": base64.b64encode(raw).decode(), "size": path.stat().st_size,
                       "sha256": sha256_file(path)})
        f = open(path, "rb")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else None
        maps.append((f, mm))
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                         key=lambda kv: kv[1]["data_offsets"][0])
        for name, meta in entries:
            begin, end = meta["data_offsets"]
            if start + end > path.stat().st_size or begin > end:
                raise ModelLoadError(f"{path}: tensor '{name}' lies outside the file")
            tensors.append({"name": name, "shard": index, "dtype": meta["dtype"], "shape": meta["shape"],
                            "begin": begin, "end": end})
            jobs.append(memoryview(mm)[start + begin:start + end] if mm is not None else memoryview(b""))
    total = sum(len(j) for j in jobs)
    done = 0
    try:
        with open(out / PACK_FILE, "wb") as pack, ThreadPoolExecutor(threads) as pool:
            pack.write(MAGIC + struct.pack("<I", VERSION))
            offset = pack.tell()
            window = []
            for i, (entry, data) in enumerate(zip(tensors, jobs)):
                window.append((entry, data, pool.submit(encode_tensor, data, entry["dtype"], level)))
                if len(window) < 2 * threads and i + 1 < len(tensors):
                    continue
                for e, d, fut in window:          # keep order; bounded look-ahead
                    encoding, blob, exp_len = fut.result()
                    e.update({"offset": offset, "length": len(blob), "encoding": encoding,
                              "exponent_length": exp_len, "crc32": zlib.crc32(d) & 0xFFFFFFFF})
                    pack.write(blob)
                    offset += len(blob)
                    done += len(d)
                    if progress:
                        progress(f"packed {done / 1e6:.1f}/{total / 1e6:.1f} MB")
                window = []
    finally:
        window = []
        for view in jobs:
            view.release()
        for f, mm in maps:
            if mm is not None:
                mm.close()
            f.close()
    files = {}
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name != MANIFEST:
            shutil.copyfile(path, out / path.name)
            files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    files[PACK_FILE] = {"size": (out / PACK_FILE).stat().st_size, "sha256": sha256_file(out / PACK_FILE)}
    manifest = {"format": FORMAT, "version": VERSION, "name": src.resolve().name, "level": level, "shards": shards, "tensors": tensors,
                "files": files}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(out / MANIFEST)
    return manifest
