"""KV codec ratio and speed on real KV from the bundled model (bf16).

Prefills windows of heldout.txt, takes each request's per-layer K and V (the
unit the core streams), and for each codec measures bytes vs bf16 and
single-thread encode / decode MB/s (MB of bf16 input per second, one core).

Sliding-window row (`sliding_window`): one 2k-token prompt through the bundled
model as is (full attention) and through the same weights with a 128-token
sliding window; bytes each codec puts on the wire when each layer sends only
what the edge can still attend to (docs/wire-format.md section 10).
"""

from __future__ import annotations

import argparse
import time

from common import ROOT, emit, progress

import numpy as np
import torch

from edgecore.protocol.codecs import CODECS, PlaneInfo
from edgecore.shared.config import CacheConfig
from edgecore.shared.engine.engine import LLMEngine

TARGETS = {"lossless": {"ratio": 0.80, "MBps": 300}, "int8": {"ratio": 0.55, "MBps": 300},
           "int4": {"ratio": 0.30}}


def real_planes(windows: int, length: int):
    model = ROOT / "models" / "pydoc-llama"
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


def sliding_window_row(length: int = 2048, window: int = 128) -> dict:
    """Per codec: encoded bytes of one `length`-token heldout prompt for the bundled model (full attention)
    and for the same weights as a Mistral config with `sliding_window = window` (its context raised to
    fit the prompt), each layer cut to the tokens it still needs (`needed_from`), as the core sends."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from edgecore.shared.kv.transfer import needed_from
    src = ROOT / "models" / "pydoc-llama"
    encoded: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, extra in (("full", {}), ("sliding", {"sliding_window": window})):
            path = Path(tmp) / kind
            shutil.copytree(src, path)
            cfg = json.loads((path / "config.json").read_text())
            cfg.update(architectures=["MistralForCausalLM"], model_type="mistral",
                       max_position_embeddings=2 * length, **extra)
            (path / "config.json").write_text(json.dumps(cfg))
            engine = LLMEngine.from_dir(path, "bf16", "cpu", CacheConfig(num_blocks=2 * length // 16))
            ids = engine.tokenizer.encode((src / "heldout.txt").read_text())[:length]
            engine.add_request("w", ids, prefill_only=True)
            while engine.has_unfinished():
                engine.step()
            starts = needed_from(engine.config, length)
            for layer, start in enumerate(starts):
                k, v = engine.read_kv("w", layer, start, length)
                for plane_kind, t in (("k", k), ("v", v)):
                    bits = t.view(torch.int16).numpy().view(np.uint16)[None]
                    info = PlaneInfo("bfloat16", bits.shape, plane_kind, start, length)
                    for name, codec in CODECS.items():
                        row = encoded.setdefault(name, {"full": 0, "sliding": 0})
                        row[kind] += len(bytes(codec.encode(bits, info)))
    return {"prompt_tokens": length, "window": window,
            "codecs": {name: {"full_bytes": r["full"], "sliding_bytes": r["sliding"],
                              "sliding_over_full": round(r["sliding"] / r["full"], 4)} for name, r in encoded.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=9)
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    progress("prefilling heldout windows for real KV")
    planes = real_planes(args.windows, args.length)
    raw = sum(p.nbytes for _, p, _ in planes)
    progress(f"{len(planes)} planes, {raw / 1e6:.1f} MB of bf16 KV")
    rows = {}
    for name, codec in CODECS.items():
        best_enc = best_dec = float("inf")
        for _ in range(args.repeats):
            encoded, t_enc, t_dec = 0, 0.0, 0.0
            for kind, bits, total in planes:
                info = PlaneInfo("bfloat16", bits.shape, kind, 0, total)
                t = time.perf_counter()
                data = codec.encode(bits, info)
                t_enc += time.perf_counter() - t
                data = bytes(data)
                t = time.perf_counter()
                out = codec.decode(data, info)
                t_dec += time.perf_counter() - t
                encoded += len(data)
                if codec.lossless:
                    assert np.array_equal(out, bits)
            best_enc, best_dec = min(best_enc, t_enc), min(best_dec, t_dec)
        rows[name] = {"ratio_vs_bf16": round(encoded / raw, 3), "encode_MBps_per_core": round(raw / best_enc / 1e6),
                      "decode_MBps_per_core": round(raw / best_dec / 1e6), "target": TARGETS.get(name)}
        progress(f"{name}: {rows[name]}")
    progress("sliding-window row: 2k-token prompt, window 128 vs full attention")
    sliding = sliding_window_row()
    progress(f"sliding window: {sliding}")
    emit("kv_codec", "lossless_ratio_vs_bf16", rows["lossless"]["ratio_vs_bf16"], codecs=rows,
         kv_megabytes=round(raw / 1e6, 2), window_tokens=args.length, sliding_window=sliding)


if __name__ == "__main__":
    main()
