"""Packed checkpoints vs plain zstd and lz4 of the same safetensors file, and load time.

For the bundled model and a synthetic ~540 MB bf16 Llama with normally
distributed weights: size ratio against the safetensors file, single-thread
decode MB/s (MB of original bytes per second, one core) for our unpack, zstd
(level 3) and lz4 of the whole file; and the time to load the model from the
packed checkpoint vs from the plain one (medians of loads taken in turn), with
the files' pages in the page cache (warm) and evicted first with posix_fadvise
(cold: as after shipping a model to an edge). Warm loads are timed twice: in
this process, where a load reuses the pages an earlier load freed, and each in
a new interpreter, as when a node starts (its own allocations fault in fresh
pages; imports are not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, median_time, progress

import lz4.frame
import torch
import zstandard

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.loader import build_model, load_model
from edgecore.shared.pack import PackedCheckpoint, pack_model

SYNTHETIC = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1536,
             "intermediate_size": 4096, "num_hidden_layers": 6, "num_attention_heads": 12,
             "num_key_value_heads": 12, "max_position_embeddings": 2048, "tie_word_embeddings": False}


def write_synthetic(path: Path) -> None:
    from safetensors.torch import save_file
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(SYNTHETIC))
    cfg = ModelConfig.from_dict(SYNTHETIC)
    model = build_model(cfg, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    h, inter = cfg.hidden_size, cfg.intermediate_size
    for name, p in model.named_parameters():
        value = torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16) \
            if p.dim() > 1 else torch.ones(p.shape, dtype=torch.bfloat16)
        if "qkv_proj" in name:
            for part, t in zip("qkv", value.split([h, h, h])):
                tensors[name.replace("qkv_proj", f"{part}_proj")] = t.contiguous()
        elif "gate_up_proj" in name:
            g, u = value.split([inter, inter])
            tensors[name.replace("gate_up_proj", "gate_proj")] = g.contiguous()
            tensors[name.replace("gate_up_proj", "up_proj")] = u.contiguous()
        else:
            tensors[name] = value
    save_file(tensors, str(path / "model.safetensors"))


def evict(directory: Path) -> None:
    """Drop a directory's files from the page cache (a cold load, as after shipping)."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# Times one load in a new interpreter: the case of a node starting (no earlier load's freed pages to reuse).
FRESH = ("import sys, time, torch; torch.set_num_threads(2); "
         "from edgecore.shared.models.loader import load_model; t = time.perf_counter(); load_model(sys.argv[1], 'bf16'); "
         "print(time.perf_counter() - t)")


def fresh_process_load(model_dir: Path) -> float:
    out = subprocess.run([sys.executable, "-c", FRESH, str(model_dir)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def cold_load(model_dir: Path) -> float:
    evict(model_dir)
    return timed(lambda: load_model(model_dir, "bf16"))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def alternating(load, plain: Path, packed: Path, repeats: int) -> tuple[float, float]:
    """Median load times of the plain and the packed model, measured in turn (plain, packed, plain, ...)
    so that neither runs systematically after the other's allocations or page-cache state."""
    times: dict[Path, list[float]] = {plain: [], packed: []}
    load(plain), load(packed)                     # warm-up: imports, allocator, page cache
    for _ in range(repeats):
        for d in (plain, packed):
            times[d].append(load(d))
    return statistics.median(times[plain]), statistics.median(times[packed])


def measure(model_dir: Path, work: Path, repeats: int) -> dict:
    original = (model_dir / "model.safetensors").read_bytes()
    size = len(original)
    packed_dir = work / f"{model_dir.name}-packed"
    t = time.perf_counter()
    pack_model(model_dir, packed_dir, threads=2)
    pack_s = time.perf_counter() - t
    packed_size = (packed_dir / "model.edgepack").stat().st_size
    reader = PackedCheckpoint(packed_dir)
    unpack_s = median_time(lambda: [reader.tensor_bytes(e) for e in reader.tensors], repeats)
    reader.close()
    zc = zstandard.ZstdCompressor(level=3).compress(original)
    zd = zstandard.ZstdDecompressor()
    zstd_s = median_time(lambda: zd.decompress(zc), repeats)
    lc = lz4.frame.compress(original)
    lz4_s = median_time(lambda: lz4.frame.decompress(lc), repeats)
    torch.set_num_threads(2)
    load_plain, load_packed = alternating(lambda d: timed(lambda: load_model(d, "bf16")),
                                          model_dir, packed_dir, repeats)
    cold_plain, cold_packed = alternating(cold_load, model_dir, packed_dir, repeats)
    fresh_plain, fresh_packed = alternating(fresh_process_load, model_dir, packed_dir, repeats)
    mb = size / 1e6
    return {
        "safetensors_MB": round(mb, 1),
        "edgecore": {"ratio": round(packed_size / size, 4), "unpack_MBps_per_core": round(mb / unpack_s),
                     "pack_s": round(pack_s, 2)},
        "zstd3": {"ratio": round(len(zc) / size, 4), "decompress_MBps": round(mb / zstd_s)},
        "lz4": {"ratio": round(len(lc) / size, 4), "decompress_MBps": round(mb / lz4_s)},
        "load_s_warm_cache": {"plain": round(load_plain, 3), "packed": round(load_packed, 3),
                              "ratio": round(load_packed / load_plain, 3)},
        "load_s_cold_cache": {"plain": round(cold_plain, 3), "packed": round(cold_packed, 3),
                              "ratio": round(cold_packed / cold_plain, 3)},
        "load_s_warm_cache_new_process": {"plain": round(fresh_plain, 3), "packed": round(fresh_packed, 3),
                                          "ratio": round(fresh_packed / fresh_plain, 3)},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-synthetic", action="store_true")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        progress("bundled model")
        results["pydoc-llama"] = measure(ROOT / "models" / "pydoc-llama", work, args.repeats)
        progress(json.dumps(results["pydoc-llama"]))
        if not args.skip_synthetic:
            progress("writing a synthetic ~540 MB bf16 model")
            synth = work / "synthetic"
            write_synthetic(synth)
            results["synthetic"] = measure(synth, work, args.repeats)
            progress(json.dumps(results["synthetic"]))
    key = "synthetic" if "synthetic" in results else "pydoc-llama"
    emit("pack", "size_ratio_vs_safetensors", results[key]["edgecore"]["ratio"],
         targets={"ratio": 0.75, "unpack_MBps_per_core": 500, "load_ratio": 1.5}, results=results)


if __name__ == "__main__":
    main()
