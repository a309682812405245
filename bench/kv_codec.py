"""KV codec ratio and speed on real KV from the bundled model (bf16).

Prefills windows of heldout.txt, takes each request's per-layer K and V (the
unit the core streams), and for each codec measures bytes vs bf16 and
single-thread encode / decode MB/s (MB of bf16 input per second of this
thread's CPU time, one core; best of --repeats). Keys are coded with the
model's RoPE given, as on the live path (shared/kv/wire.py `codec_rope`);
the model's bit allocation is not (it moves bytes between layers, not speed).

The machine is shared, so every speed also comes as a ratio to baselines
measured in the same run on the same bytes: a memcpy, lz4 (frame, default
level) compress / decompress, and `quantize_floor`, the passes every q*e encode
makes whatever its statistics (widen, multiply-add, clip, cast, pack, zstd-1):
a bound on what numpy on this machine allows. With `--before REF`, the codecs of git revision
REF (protocol/ at REF, imported under another package name) are measured
interleaved with today's, plane by plane, so before/after share the machine's
load.

Sliding-window row (`sliding_window`): one 2k-token prompt through the bundled
model as is (full attention) and through the same weights with a 128-token
sliding window; bytes each codec puts on the wire when each layer sends only
what the edge can still attend to (docs/wire-format.md section 10).

Wide heads (`wide_heads`): encode / decode speeds on synthetic planes of a larger model's shape (8 KV
heads × 128, `--length` tokens), where per-call costs weigh less than on the bundled model's 2 × 32.

Byte breakdown (`breakdown`, `--breakdown 256,1000`): for each entropy-coded level at each prompt
length (whole prompts as one chunk per layer, as bench/kv_rd.py codes them), the share of bf16 bytes
spent on headers + CRC, exact (sink/recent) tokens, centres + steps, and codes, with the codes' bits
per quantized value.

`--model models/pystd-mla` measures the trained MLA model's latent KV instead (planes "latent" and
"rope" in the K and V places, as on the wire; the rope plane coded one step finer, `plane_codecs`) and
writes `kv_codec_mla.json`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, progress

import lz4.frame
import numpy as np
import torch

from edgecore.protocol.codecs import CODECS, PlaneInfo
from edgecore.protocol.kv import plane_codecs
from edgecore.shared.models.config import CacheConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.kv.wire import codec_rope

TARGETS = {"lossless": {"ratio": 0.80, "MBps": 300}, "int8": {"ratio": 0.55, "MBps": 300},
           "int4": {"ratio": 0.30}, "q4e": {"MBps": 300}, "q3e": {"MBps": 300}, "q2e": {"MBps": 300}}


def real_planes(windows: int, length: int, model=ROOT / "models" / "pydoc-llama"):
    engine = LLMEngine.from_dir(model, "fp32", "cpu", CacheConfig(num_blocks=4096))
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
            for kind, t in (("k", k), ("v", v)):       # float32 model, KV rounded to bf16 as a bf16 core holds it
                bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)[None]
                planes.append((kind, layer, bits, len(chunk)))
        engine.release(rid)
    return planes, codec_rope(engine.config)


def codecs_at(ref: str) -> dict:
    """The codec registry of git revision `ref`: its protocol/ package extracted and imported as
    `edgecore_<ref>.protocol` (protocol/ imports nothing outside itself)."""
    name = "edgecore_" + re.sub(r"\W", "_", ref)
    root = Path(tempfile.mkdtemp(prefix="kv-codec-before-")) / name
    root.mkdir()
    files = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", ref, "protocol"],
                           check=True, capture_output=True, text=True).stdout.split()
    for path in files:
        if not path.endswith(".py"):
            continue
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{path}"], check=True, capture_output=True,
                              text=True).stdout
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text.replace("edgecore.protocol", f"{name}.protocol"))
    (root / "__init__.py").write_text("")
    sys.path.insert(0, str(root.parent))
    return importlib.import_module(f"{name}.protocol.codecs").CODECS


def quantize_floor(bits: np.ndarray) -> bytes:
    """The least a q*e encoder does to a plane, with no statistics and no RoPE: widen bf16 to float32, one
    per-channel multiply and add, clip, cast to codes, pack nibbles, zstd-1 (a speed floor, not a codec)."""
    from edgecore.protocol.codecs.base import bits_to_f32, scratch, zstd_compress
    from edgecore.protocol.codecs.codes import pack_nibbles
    x = bits_to_f32(bits, "bfloat16", scratch("floor_x", bits.shape, np.float32))
    x *= np.float32(3.0)
    x += np.full(bits.shape[2:], 8.5, dtype=np.float32)
    np.clip(x, 0.0, 15.5, out=x)
    codes = scratch("floor_codes", bits.shape, np.uint8)
    np.copyto(codes, x, casting="unsafe")
    return zstd_compress(pack_nibbles(codes.reshape(-1)))


def baselines(planes, repeats: int) -> dict:
    raw = sum(p.nbytes for _, _, p, _ in planes)
    best = {"memcpy": float("inf"), "lz4_compress": float("inf"), "lz4_decompress": float("inf"),
            "quantize_floor": float("inf")}
    for _ in range(repeats):
        spent = dict.fromkeys(best, 0.0)
        for _, _, bits, _ in planes:
            out = np.empty_like(bits)
            t = time.thread_time()
            np.copyto(out, bits)
            spent["memcpy"] += time.thread_time() - t
            t = time.thread_time()
            z = lz4.frame.compress(bits.data)
            spent["lz4_compress"] += time.thread_time() - t
            t = time.thread_time()
            lz4.frame.decompress(z)
            spent["lz4_decompress"] += time.thread_time() - t
            t = time.thread_time()
            quantize_floor(bits)
            spent["quantize_floor"] += time.thread_time() - t
        best = {k: min(best[k], spent[k]) for k in best}
    return {k: round(raw / max(v, 1e-9) / 1e6) for k, v in best.items()}


def measure(sets: dict[str, dict], planes, rope, repeats: int, mla: bool = False) -> dict:
    """{label: {codec: (ratio, encode MB/s, decode MB/s)}}; the labels' codecs alternate plane by plane.
    For MLA the rope plane (in the "v" place) goes through the finer codec the wire uses for it."""
    raw = sum(p.nbytes for _, _, p, _ in planes)
    names = [n for n in next(iter(sets.values())) if not n.startswith("__") and all(n in s for s in sets.values())]
    rows: dict[str, dict] = {label: {} for label in sets}
    for name in names:
        best = {label: [float("inf"), float("inf"), 0] for label in sets}
        for _ in range(repeats):
            spent = {label: [0.0, 0.0, 0] for label in sets}
            for kind, layer, bits, total in planes:
                for label, codecs in sets.items():
                    codec = codecs[plane_codecs(name, mla)[1]] if mla and kind == "v" else codecs[name]
                    info = codecs["__info__"](bits.shape, kind, total, layer, rope)
                    t = time.thread_time()
                    data = codec.encode(bits, info)
                    spent[label][0] += time.thread_time() - t
                    data = bytes(data)
                    t = time.thread_time()
                    out = codec.decode(data, info)
                    spent[label][1] += time.thread_time() - t
                    spent[label][2] += len(data)
                    if codec.lossless and not np.array_equal(out, bits):
                        raise SystemExit(f"{label} {name} is not bit-exact")
            for label in sets:
                b, s = best[label], spent[label]
                best[label] = [min(b[0], s[0]), min(b[1], s[1]), s[2]]
        for label in sets:
            enc, dec, size = best[label]
            rows[label][name] = {"ratio_vs_bf16": round(size / raw, 4), "encode_MBps_per_core": round(raw / enc / 1e6),
                                 "decode_MBps_per_core": round(raw / dec / 1e6)}
        progress(f"{name}: " + "  ".join(f"{label} {rows[label][name]}" for label in sets))
    return rows


def breakdown(lengths: list[int], model: Path) -> dict:
    """{length: {level: byte shares}} of the entropy-coded levels on real KV (see the module doc)."""
    from edgecore.protocol.codecs.equant import HEADER, EntropyQuantCodec
    out = {}
    for length in lengths:
        planes, rope = real_planes(max(2, 4096 // length), length, model)
        raw = sum(p.nbytes for _, _, p, _ in planes)
        rows = {}
        for name, codec in CODECS.items():
            if not isinstance(codec, EntropyQuantCodec):
                continue
            acc, quantized = {"header": 0, "exact": 0, "params": 0, "codes": 0}, 0
            for kind, layer, bits, total in planes:
                info = PlaneInfo("bfloat16", bits.shape, kind, 0, total, layer, rope if kind == "k" else None)
                head = HEADER.unpack_from(bytes(codec.encode(bits, info)))
                for key, size in zip(acc, (HEADER.size, *head[8:11])):
                    acc[key] += size
                quantized += bits.size // bits.shape[1] * (bits.shape[1] - head[5] - head[7])
            rows[name] = {"ratio_vs_bf16": round(sum(acc.values()) / raw, 4),
                          **{f"{k}_vs_bf16": round(v / raw, 4) for k, v in acc.items()},
                          "code_bits_per_quantized_value": round(8 * acc["codes"] / max(quantized, 1), 3)}
        out[str(length)] = rows
        progress(f"breakdown at {length} tokens: {rows}")
    return out


def _info_maker(plane_info):
    def make(shape, kind, total, layer, rope):
        return plane_info("bfloat16", shape, kind, 0, total, layer, rope if kind == "k" else None)
    return make


def sliding_window_row(length: int = 2048, window: int = 128) -> dict:
    """Per codec: encoded bytes of one `length`-token heldout prompt for the bundled model (full attention)
    and for the same weights as a Mistral config with `sliding_window = window` (its context raised to
    fit the prompt), each layer cut to the tokens it still needs (`needed_from`), as the core sends."""
    import json
    import shutil

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


def wide_planes(tokens: int = 1000, heads: int = 8, dim: int = 128, layers: int = 2, seed: int = 0):
    """Synthetic bf16 planes of a larger model's KV shape (8 KV heads × 128, as Llama-3-8B), Gaussian per
    channel with its own scale and offset, and that model's RoPE: per-call costs weigh less here than on
    the bundled model's 2 × 32 heads. Speeds only: the bytes of synthetic KV say nothing."""
    rng = np.random.default_rng(seed)
    planes = []
    for layer in range(layers):
        for kind in "kv":
            x = (rng.standard_normal((1, tokens, heads, dim)) * rng.gamma(2.0, 0.5, (1, 1, heads, dim))
                 + rng.standard_normal((1, 1, heads, dim))).astype(np.float32)
            planes.append((kind, layer, (x.view(np.uint32) >> 16).astype(np.uint16), tokens))
    return planes, tuple(float(f) for f in 1.0 / 500000.0 ** (np.arange(dim // 2) / (dim // 2)))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=9)
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", metavar="REF", help="also measure the codecs of this git revision, interleaved")
    ap.add_argument("--no-rope", action="store_true", help="code keys rotated (no RoPE given to the codecs)")
    ap.add_argument("--model", default=str(ROOT / "models" / "pydoc-llama"))
    ap.add_argument("--no-wide", dest="wide", action="store_false", help="skip the synthetic 8 × 128-head speed rows")
    ap.add_argument("--breakdown", default="256,1000", help="prompt lengths of the byte breakdown ('' for none)")
    args = ap.parse_args()
    mla = json.loads((Path(args.model) / "config.json").read_text()).get("kv_lora_rank") is not None
    torch.set_num_threads(1)
    progress("prefilling heldout windows for real KV")
    planes, rope = real_planes(args.windows, args.length, Path(args.model))
    rope = None if args.no_rope else rope
    raw = sum(p.nbytes for _, _, p, _ in planes)
    progress(f"{len(planes)} planes, {raw / 1e6:.1f} MB of bf16 KV")
    sets = {"now": {**CODECS, "__info__": _info_maker(PlaneInfo)}}
    if args.before:
        old = codecs_at(args.before)
        old_info = importlib.import_module(type(next(iter(old.values()))).__module__.rsplit(".", 1)[0] + ".base")
        sets["before"] = {**old, "__info__": _info_maker(old_info.PlaneInfo)}
    base = baselines(planes, args.repeats)
    rows = measure(sets, planes, rope, args.repeats, mla)
    base_after = baselines(planes, args.repeats)
    base = {k: min(base[k], base_after[k]) for k in base}     # the slower of the two: load drifts
    for label_rows in rows.values():
        for name, row in label_rows.items():
            row["encode_vs_lz4_compress"] = round(row["encode_MBps_per_core"] / base["lz4_compress"], 3)
            row["decode_vs_lz4_decompress"] = round(row["decode_MBps_per_core"] / base["lz4_decompress"], 3)
            row["encode_vs_memcpy"] = round(row["encode_MBps_per_core"] / base["memcpy"], 4)
            row["encode_vs_quantize_floor"] = round(row["encode_MBps_per_core"] / base["quantize_floor"], 3)
            row["decode_vs_memcpy"] = round(row["decode_MBps_per_core"] / base["memcpy"], 4)
            row["target"] = TARGETS.get(name)
    wide = None
    if not mla and args.wide:
        progress("wide-head rows: synthetic 8 × 128 planes")
        w_planes, w_rope = wide_planes(args.length)
        wide = {"shape": list(w_planes[0][2].shape), "note": "synthetic KV: speeds only",
                **{label: {n: {k: v for k, v in r.items() if k != "ratio_vs_bf16"} for n, r in label_rows.items()}
                   for label, label_rows in measure(sets, w_planes, w_rope, args.repeats).items()}}
    sliding = None
    shares = breakdown([int(n) for n in args.breakdown.split(",") if n], Path(args.model)) if not mla else None
    if not mla:
        progress("sliding-window row: 2k-token prompt, window 128 vs full attention")
        sliding = sliding_window_row()
        progress(f"sliding window: {sliding}")
    emit("kv_codec_mla" if mla else "kv_codec", "lossless_ratio_vs_bf16", rows["now"]["lossless"]["ratio_vs_bf16"], codecs=rows["now"],
         before={"ref": args.before, "codecs": rows["before"]} if args.before else None,
         baselines_MBps_per_core=base, rope_given=rope is not None, kv_megabytes=round(raw / 1e6, 2),
         window_tokens=args.length, timing="thread CPU time, best of repeats", sliding_window=sliding,
         breakdown=shares, wide_heads=wide)


if __name__ == "__main__":
    main()
