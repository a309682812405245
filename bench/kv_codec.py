"""KV codec ratio and speed on real KV from the bundled model (bf16).

Prefills windows of heldout.txt, takes each request's per-layer K and V (the
unit the core streams), and for each codec measures bytes vs bf16 and
single-thread encode / decode MB/s (MB of bf16 input per second, one core).
`--model models/pystd-mla` measures the trained MLA model's latent KV instead (planes "latent" and
"rope" in the K and V places, as on the wire) and writes `kv_codec_mla.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import ROOT, emit, progress

import numpy as np
import torch

from edgecore.protocol.codecs import CODECS, PlaneInfo
from edgecore.protocol.kv import plane_codecs
from edgecore.shared.config import CacheConfig
from edgecore.shared.engine.engine import LLMEngine

TARGETS = {"lossless": {"ratio": 0.80, "MBps": 300}, "int8": {"ratio": 0.55, "MBps": 300},
           "int4": {"ratio": 0.30}}


def real_planes(windows: int, length: int, model=ROOT / "models" / "pydoc-llama"):
    engine = LLMEngine.from_dir(model, "bf16", "cpu", CacheConfig(num_blocks=4096))
    ids = engine.tokenizer.encode((model / "heldout.txt").read_text())
    planes = []
    for w in range(windows):
        chunk = ids[w * length: (w + 1) * length]
        if len(chunk) < length:
            break
        rid = f"w{w}"
        engine.add_request(rid, chunk, prefill_only=True)
        while engine.has_unfinished():
            engine.step()
        for layer in range(engine.config.num_hidden_layers):
            k, v = engine.read_kv(rid, layer)
            for kind, t in (("k", k), ("v", v)):
                bits = t.view(torch.int16).numpy().view(np.uint16)[None]
                planes.append((kind, bits, len(chunk)))
        engine.release(rid)
    return planes


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=9)
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=str(ROOT / "models" / "pydoc-llama"))
    args = ap.parse_args()
    mla = json.loads((Path(args.model) / "config.json").read_text()).get("kv_lora_rank") is not None
    torch.set_num_threads(1)
    progress("prefilling heldout windows for real KV")
    planes = real_planes(args.windows, args.length, Path(args.model))
    raw = sum(p.nbytes for _, p, _ in planes)
    progress(f"{len(planes)} planes, {raw / 1e6:.1f} MB of bf16 KV")
    rows = {}
    for name, codec in CODECS.items():
        best_enc = best_dec = float("inf")
        for _ in range(args.repeats):
            encoded, t_enc, t_dec = 0, 0.0, 0.0
            for kind, bits, total in planes:
                impl = CODECS[plane_codecs(name, mla)[1]] if kind == "v" else codec     # MLA: finer rope plane
                info = PlaneInfo("bfloat16", bits.shape, kind, 0, total)
                t = time.perf_counter()
                data = impl.encode(bits, info)
                t_enc += time.perf_counter() - t
                data = bytes(data)
                t = time.perf_counter()
                out = impl.decode(data, info)
                t_dec += time.perf_counter() - t
                encoded += len(data)
                if codec.lossless:
                    assert np.array_equal(out, bits)
            best_enc, best_dec = min(best_enc, t_enc), min(best_dec, t_dec)
        rows[name] = {"ratio_vs_bf16": round(encoded / raw, 3), "encode_MBps_per_core": round(raw / best_enc / 1e6),
                      "decode_MBps_per_core": round(raw / best_dec / 1e6), "target": TARGETS.get(name)}
        progress(f"{name}: {rows[name]}")
    emit("kv_codec_mla" if mla else "kv_codec", "lossless_ratio_vs_bf16", rows["lossless"]["ratio_vs_bf16"], codecs=rows,
         kv_megabytes=round(raw / 1e6, 2), window_tokens=args.length)


if __name__ == "__main__":
    main()
