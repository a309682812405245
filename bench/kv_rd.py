"""Rate–distortion curve of every KV codec and level on a model: bytes vs quality, and speed.

    .venv/bin/python bench/kv_rd.py [--model DIR] [--prompts 30] [--prompt-len 256] [--new-tokens 64]

For each of N windows of held-out text (the model's `heldout.txt`, else docstrings of
Python's standard library): prefill the prompt, then for each codec replace the prompt's
KV by its round trip through the codec — one chunk per layer, as the core streams it —
and teacher-force two continuations against it. Reported per codec against the
uncompressed bf16 KV:
- ratio_vs_bf16: encoded bytes / bf16 bytes of the prompts' KV (headers included),
- ppl_increase: perplexity of the real held-out continuation, relative change,
- mean_kl: KL(exact ‖ codec) of the next-token distributions along the exact greedy run,
- agreement: how often the codec's argmax equals the exact run's, at each of those
  positions (teacher-forced: one early miss does not count the rest as misses),
- encode / decode MB/s of bf16 input per core, in CPU time of the calling thread (the
  machines are shared; wall time is printed beside it), side by side with `int8`.
Lossy codecs are measured as the live path sends them: the edge computes layer 0's KV itself (it depends on
the tokens alone; edge/remote_prefill.py) when that costs at most `--layer0-budget-macs` per prompt, so layer 0
is exact and costs no bytes; rows NAME+layer0 code every layer (the edge's `--layer0-budget-macs 0`).
The model computes in float32 by default and the KV is rounded to bf16 before any codec
(and for the reference), so the curve isolates the codec's error; `--dtype bf16` runs the
model in bf16. Writes one JSON line, bench/results/NAME.json and NAME.png (matplotlib,
the `bench` extra). `--sensitivity LEVEL` adds per-layer KL with only one layer (K or V)
coded at that level — the measurement behind per-layer bit allocation; `--channels A:B`, per-channel steps
(bench/kv_alloc.py; rows NAME-layers: the model's allocation without its channel scales).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import importlib
import math
import time
from pathlib import Path

from common import RESULTS, ROOT, emit, progress, pyplot
import kv_klt
from kv_alloc import Allocated, allocation, channel_scales, channel_weights

import numpy as np
import torch

from edgecore.protocol.codecs import CODECS, Codec, PlaneInfo
from edgecore.protocol.codecs.equant import EntropyQuantCodec, Level
from edgecore.shared.models.config import CacheConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.sequence import Sequence
from edgecore.edge.node import EdgeConfig
from edgecore.shared.kv.transfer import layers_at_edge
from edgecore.shared.kv.wire import ALLOCATION_FILE, codec_rope, codec_step_scales, from_bits, to_bits

TARGETS = {"ratio_0.15": {"ratio_vs_bf16": 0.15, "ppl_increase": 0.01, "agreement": 0.97},
           "ratio_0.25": {"ratio_vs_bf16": 0.25, "ppl_increase": 0.003}}
FAMILIES = {"lossless": "lossless", "fp8": "fp8", "int8": "int (KIVI)", "int4": "int (KIVI)"}
DOC_MODULES = ("collections", "itertools", "functools", "json", "re", "os", "pathlib", "argparse", "asyncio",
               "typing", "dataclasses", "subprocess", "threading", "logging", "unittest", "csv", "sqlite3",
               "shutil", "socket", "datetime", "decimal", "fractions", "statistics", "string", "textwrap",
               "zipfile", "tarfile", "email.message", "http.client", "urllib.parse", "xml.etree.ElementTree")


def heldout_text(model: Path) -> str:
    path = model / "heldout.txt"
    if path.is_file():
        return path.read_text()
    docs = []
    for name in DOC_MODULES:
        mod = importlib.import_module(name)
        docs.append(inspect.getdoc(mod) or "")
        docs += [inspect.getdoc(obj) or "" for _, obj in sorted(vars(mod).items())
                 if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", "") == name]
    return "\n\n".join(d for d in docs if d)


class Run:
    """One prompt prefilled in the engine (room for a continuation of `cont` tokens after it); its KV
    can be swapped for a codec's round trip and continuations teacher-forced against it."""

    def __init__(self, engine: LLMEngine, prompt: list[int], cont: int):
        self.engine, self.n = engine, len(prompt)
        self.seq = Sequence("rd", list(prompt) + [0] * cont, SamplingParams())
        engine.block_manager.allocate_prompt(self.seq.table, self.seq.token_ids, self.seq.num_tokens)
        self._forward(self.n, 0)
        self.slots = engine.pool.slots(self.seq.table.blocks, 0, self.n)
        # The bf16 KV the core would send: per kind, [1, tokens, heads, dim] bits per layer.
        self.bits = {"k": [], "v": []}
        for layer in range(engine.config.num_hidden_layers):
            for kind, t in zip("kv", engine.pool.read(layer, self.slots)):
                self.bits[kind].append(to_bits(t.to(torch.bfloat16))[None])

    @torch.inference_mode()
    def _forward(self, count: int, start: int) -> torch.Tensor:
        self.seq.num_computed_tokens = start
        _, tok, pos, meta = self.engine.runner.prepare([(self.seq, count)])
        return self.engine.model(tok, pos, meta)

    def load(self, planes: dict[str, list[np.ndarray]]) -> None:
        pool = self.engine.pool
        for layer, (k, v) in enumerate(zip(planes["k"], planes["v"])):
            pool.write(layer, self.slots, from_bits(k[0], "bfloat16"), from_bits(v[0], "bfloat16"))

    @torch.inference_mode()
    def logits(self, cont: list[int]) -> torch.Tensor:
        """Logits predicting cont[1:] given the prompt's KV as loaded."""
        self.seq.token_ids[self.n:self.n + len(cont)] = cont
        hidden = self._forward(len(cont), self.n)
        return self.engine.model.compute_logits(hidden[:-1]).float()

    def close(self):
        self.engine.block_manager.free_table(self.seq.table)


def model_allocation(engine, model: Path, calib, codecs, channels, args) -> tuple[dict, dict | None]:
    """The bit allocation the model's core uses (its kv_allocation.json), or with --allocate LEVEL one
    calibrated now on `calib` windows, per layer, on top of `channels` (per-channel scales, the first
    --channels setting's; written to the model directory with --write-allocation)."""
    if not args.allocate:
        scales = {} if args.no_allocation else codec_step_scales(model)
        return scales, {"source": str(model / ALLOCATION_FILE), "step_scales": {k: scales[k] for k in "kv" if k in scales},
                        "channel_scales": any(k.endswith("_channels") for k in scales)} if scales else None
    greedy = [r["token_ids"] for r in engine.generate([w[:args.prompt_len] for w in calib], SamplingParams(
        max_tokens=args.new_tokens, temperature=0, ignore_eos=True))]
    level = codecs.get(args.allocate) or CODECS[args.allocate]
    kl = sensitivity(engine, calib, greedy, Allocated(level, channels[1]) if channels else level,
                     engine.config.num_hidden_layers, args)
    scales = allocation(kl, engine.config.num_hidden_layers)
    progress(f"allocation from {args.allocate}: {scales}")
    info = {"level": args.allocate, "calibration_windows": len(calib), "prompt_tokens": args.prompt_len,
            "mean_kl": kl, "step_scales": scales}
    if channels:
        (a, b), ch = channels
        info.update(channel_exponents={"a": a, "b": b},
                    channel_scales={kind: [list(row) for row in ch[f"{kind}_channels"]] for kind in "kv"})
        scales = {**scales, **ch}
    if args.write_allocation:
        (model / ALLOCATION_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return scales, info


class AllLayers(Codec):
    """A lossy level with every layer coded, layer 0 included (the edge's `--layer0-budget-macs 0`)."""

    def __init__(self, codec: Codec):
        self.codec, self.name, self.codec_id, self.lossless = codec, f"{codec.name}+layer0", codec.codec_id, False

    def encode(self, bits, info):
        return self.codec.encode(bits, info)

    def decode(self, data, info):
        return self.codec.decode(data, info)


def skipped_layers(codec: Codec, args) -> int:
    """Leading layers the live path does not send with this codec: the edge computes layer 0 for a lossy codec
    within its budget (edge/remote_prefill.py); `AllLayers` and lossless codecs send every layer."""
    return 0 if codec.lossless or isinstance(codec, AllLayers) else args.edge_layers


def round_trip(codec: Codec, bits: dict[str, list[np.ndarray]], n: int, rope, only_layer: int | None = None,
               only_kind: str | None = None, skip_layers: int = 0):
    """Every layer from `skip_layers` on as one chunk through the codec (the skipped ones exact, no bytes: the
    edge computes them): (decoded planes, encoded bytes, enc s, dec s)."""
    out = {"k": [], "v": []}
    size, t_enc, t_dec = 0, 0.0, 0.0
    for kind in "kv":
        for layer, plane in enumerate(bits[kind]):
            if (only_layer is not None and layer != only_layer) or (only_kind and kind != only_kind) \
                    or layer < skip_layers:
                out[kind].append(plane)
                continue
            info = PlaneInfo("bfloat16", plane.shape, kind, 0, n, layer, rope)
            t = time.thread_time()
            data = bytes(codec.encode(plane, info))
            t_enc += time.thread_time() - t
            t = time.thread_time()
            out[kind].append(codec.decode(data, info))
            t_dec += time.thread_time() - t
            size += len(data)
    return out, size, t_enc, t_dec


def parse_level(spec: str) -> tuple[str, Codec]:
    """NAME=KEY_FACTOR:VALUE_FACTOR[:RECENT[:FINE[:FINE_FACTOR]]] → an unregistered entropy-coded level
    (a NAME starting with `noguard` clips outliers instead of widening the step; one containing `compact` sends
    log-coded steps and one centre for the main and fine spans)."""
    name, _, rest = spec.partition("=")
    parts = [float(x) for x in rest.split(":")]
    level = Level(parts[0], parts[1], *(int(x) for x in parts[2:4]), *parts[4:5])
    if "flat" in name:
        level = dataclasses.replace(level, head_step=True)
    if name.startswith("noguard"):
        level = dataclasses.replace(level, guard=False)
    if "compact" in name:
        level = dataclasses.replace(level, compact=True)
    return name, EntropyQuantCodec(name, 255, level)


def kl_agree(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, int]:
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum().item(), int((got.argmax(-1) == ref.argmax(-1)).sum())


def nll(logits: torch.Tensor, target: list[int]) -> float:
    return -logits.log_softmax(-1).gather(1, torch.tensor(target)[:, None]).sum().item()


def evaluate(engine, windows, greedy, codecs: dict[str, Codec], args) -> dict:
    sums = {name: {"nll": 0.0, "kl": 0.0, "agree": 0, "bytes": 0, "enc": 0.0, "dec": 0.0} for name in codecs}
    base_nll, raw, count = 0.0, 0, 0
    for i, (w, g) in enumerate(zip(windows, greedy)):
        prompt, held = w[:args.prompt_len], w[args.prompt_len:]
        run = Run(engine, prompt, args.new_tokens)
        try:
            run.load(run.bits)                      # the reference: bf16 KV
            ref_g, ref_h = run.logits(g), run.logits(held)
            base_nll += nll(ref_h, held[1:])
            raw += sum(p.nbytes for kind in "kv" for p in run.bits[kind])
            count += ref_g.shape[0]
            for name, codec in codecs.items():
                planes, size, t_enc, t_dec = round_trip(codec, run.bits, run.n, args.rope,
                                                        skip_layers=skipped_layers(codec, args))
                run.load(planes)
                kl, agree = kl_agree(ref_g, run.logits(g))
                row = sums[name]
                row["nll"] += nll(run.logits(held), held[1:])
                row["kl"] += kl
                row["agree"] += agree
                row["bytes"] += size
                row["enc"] += t_enc
                row["dec"] += t_dec
        finally:
            run.close()
        progress(f"prompt {i + 1}/{len(windows)}")
    targets = len(windows) * (args.new_tokens - 1)
    base_ppl = math.exp(base_nll / targets)
    rows = {}
    for name, r in sums.items():
        ppl = math.exp(r["nll"] / targets)
        rows[name] = {"ratio_vs_bf16": round(r["bytes"] / raw, 4), "ppl_increase": round(ppl / base_ppl - 1, 5),
                      "mean_kl": round(r["kl"] / count, 6), "agreement": round(r["agree"] / count, 4)}
    return {"base_ppl": round(base_ppl, 4), "rows": rows, "kv_bytes": raw}


def speed(planes: list[tuple[str, np.ndarray, int]], codecs: dict[str, Codec], repeats: int, rope) -> dict:
    """Best-of-`repeats` MB/s of bf16 input: per core (thread CPU time) and wall."""
    raw = sum(p.nbytes for _, p, _ in planes)
    out = {}
    for name, codec in codecs.items():
        best = {"enc": math.inf, "dec": math.inf, "enc_wall": math.inf, "dec_wall": math.inf}
        for _ in range(repeats):
            acc = dict.fromkeys(best, 0.0)
            for kind, plane, layer in planes:
                info = PlaneInfo("bfloat16", plane.shape, kind, 0, plane.shape[1], layer, rope)
                c, w = time.thread_time(), time.perf_counter()
                data = bytes(codec.encode(plane, info))
                acc["enc"] += time.thread_time() - c
                acc["enc_wall"] += time.perf_counter() - w
                c, w = time.thread_time(), time.perf_counter()
                codec.decode(data, info)
                acc["dec"] += time.thread_time() - c
                acc["dec_wall"] += time.perf_counter() - w
            best = {k: min(best[k], acc[k]) for k in best}
        out[name] = {"encode_MBps_per_core": round(raw / best["enc"] / 1e6),
                     "decode_MBps_per_core": round(raw / best["dec"] / 1e6),
                     "encode_MBps_wall": round(raw / best["enc_wall"] / 1e6),
                     "decode_MBps_wall": round(raw / best["dec_wall"] / 1e6)}
        progress(f"speed {name}: {out[name]}")
    return out


def sensitivity(engine, windows, greedy, codec: Codec, layers: int, args) -> dict:
    """Mean KL with only one layer's K (or V) coded by `codec`."""
    kls = {f"{kind}{layer}": 0.0 for kind in "kv" for layer in range(layers)}
    count = 0
    for w, g in zip(windows, greedy):
        run = Run(engine, w[:args.prompt_len], args.new_tokens)
        try:
            run.load(run.bits)
            ref = run.logits(g)
            count += ref.shape[0]
            for key in kls:
                planes, *_ = round_trip(codec, run.bits, run.n, args.rope, only_layer=int(key[1:]), only_kind=key[0])
                run.load(planes)
                kls[key] += kl_agree(ref, run.logits(g))[0]
        finally:
            run.close()
    return {key: round(v / count, 6) for key, v in kls.items()}


def plot(rows: dict, path: Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    families: dict[str, list] = {}
    for name, r in rows.items():
        family = FAMILIES.get(name) or (f"qNe, channel steps ∝ std^a·w^-b, a:b = {name.split('@')[1]}"
                                        if "@" in name else "qNe, one step factor for all layers" if name.endswith("-uniform") else
                                        "qNe, per-layer allocation only" if name.endswith("-layers") else
                                        "qNe in a calibrated basis (experiment)" if name.endswith("+klt") else
                                        "qNe, layer 0 sent too" if name.endswith("+layer0") else
                                        "entropy-coded (qNe)")
        families.setdefault(family, []).append((r["ratio_vs_bf16"], r, name))
    for fam, pts in families.items():
        pts.sort(key=lambda p: p[0])
        ax.plot([p[0] for p in pts], [100 * p[1]["ppl_increase"] for p in pts], "o-", label=fam)
        for x, r, name in pts:
            ax.annotate(name, (x, 100 * r["ppl_increase"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.5, ls="--")
    ax.axvline(0.15, color="grey", lw=0.5, ls="--")
    ax.set_xlabel("bytes vs bf16 KV")
    ax.set_ylabel("perplexity increase (%)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "pydoc-llama"))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--codecs", default=",".join(c for c in CODECS if c != "raw"))
    ap.add_argument("--level", action="append", default=[], help="extra level NAME=KF:VF[:RECENT[:FINE[:FINE_FACTOR]]]")
    ap.add_argument("--sensitivity", default=None, help="per-layer KL of this level (one layer at a time)")
    ap.add_argument("--allocate", default=None, metavar="LEVEL",
                    help="calibrate a per-layer bit allocation from LEVEL's sensitivity on windows between the "
                         "evaluated ones and run the entropy-coded levels with it (the uniform ones as NAME-uniform)")
    ap.add_argument("--write-allocation", action="store_true",
                    help="with --allocate: write it to the model directory's kv_allocation.json (the core uses it)")
    ap.add_argument("--channels", action="append", default=[], metavar="A:B",
                    help="per-channel steps ∝ std^A · weight^-B (bench/kv_alloc.py), calibrated on the --allocate "
                         "windows: the levels run as NAME@A:B (with --allocate: the first setting is allocated)")
    ap.add_argument("--no-allocation", action="store_true", help="ignore the model's kv_allocation.json")
    ap.add_argument("--klt", action="store_true",
                    help="experiment: add every entropy-coded level run in a per-head basis calibrated on windows "
                         "between the evaluated ones (NAME+klt; bench/kv_klt.py)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-rope", action="store_true", help="do not give codecs the model's RoPE (keys coded rotated)")
    ap.add_argument("--name", default="kv_rd", help="result file name (bench/results/NAME.json, NAME.png)")
    ap.add_argument("--layer0-budget-macs", "--first-layer-macs", type=float, default=EdgeConfig.layer0_budget_macs,
                    help="as the edge's flag: lossy levels leave layer 0 to the edge when computing it costs at most "
                         "this many multiply-adds per prompt (rows NAME+layer0: every layer coded anyway)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = Path(args.model)
    engine = LLMEngine.from_dir(model, args.dtype, "cpu", CacheConfig(num_blocks=1024, enable_prefix_caching=False))
    args.rope = None if args.no_rope else codec_rope(engine.config)
    # the edge's rule for a lossy transfer of one prompt (edge/remote_prefill.py)
    args.edge_layers = layers_at_edge(engine.runner.layer0_macs_per_token, args.prompt_len, args.layer0_budget_macs, False)
    ids = engine.tokenizer.encode(heldout_text(model))
    span = args.prompt_len + args.new_tokens
    if len(ids) < span:
        raise SystemExit(f"held-out text of {model} has {len(ids)} tokens, fewer than one window of {span}")
    stride = max(1, (len(ids) - span) // max(1, args.prompts - 1))
    windows = [ids[i * stride: i * stride + span] for i in range(args.prompts) if i * stride + span <= len(ids)]
    progress(f"{model.name}: {len(windows)} windows of {args.prompt_len}+{args.new_tokens} tokens; exact greedy runs")
    greedy = [r["token_ids"] for r in engine.generate([w[:args.prompt_len] for w in windows], SamplingParams(
        max_tokens=args.new_tokens, temperature=0, ignore_eos=True))]
    codecs = {name: CODECS[name] for name in args.codecs.split(",") if name}
    codecs.update(parse_level(spec) for spec in args.level)
    extra = {}
    calib = [ids[i * stride + stride // 2: i * stride + stride // 2 + span] for i in range(10)
             if i * stride + stride // 2 + span <= len(ids)]
    levels = {n: c for n, c in codecs.items() if isinstance(c, EntropyQuantCodec)}
    if args.klt:
        runs = [Run(engine, w[:args.prompt_len], args.new_tokens) for w in calib]
        bases = kv_klt.calibrate([r.bits for r in runs], args.rope)
        for r in runs:
            r.close()
        codecs.update({f"{n}+klt": kv_klt.KLTLevel(c, bases, args.rope) for n, c in levels.items()})
    settings = [tuple(float(x) for x in spec.split(":")) for spec in args.channels]
    per_channel = []
    if settings:
        weights, stds = channel_weights(engine, lambda w: Run(engine, w[:args.prompt_len], args.new_tokens),
                                        calib, args.rope)
        per_channel = [((a, b), channel_scales(weights, stds, a, b)) for a, b in settings]
    scales, extra["allocation"] = model_allocation(engine, model, calib, codecs,
                                                   per_channel[0] if per_channel else None, args)
    if scales:      # the levels as the model's core runs them; the uniform ones beside them
        codecs.update({f"{n}-uniform": c for n, c in levels.items()})
        if "k_channels" in scales or "v_channels" in scales:     # and with the per-layer multipliers only
            layer_only = {kind: scales.get(kind, ()) for kind in "kv"}
            codecs.update({f"{n}-layers": Allocated(c, layer_only, f"{n}-layers") for n, c in levels.items()})
        codecs.update({n: Allocated(c, scales) for n, c in levels.items()})
    for (a, b), ch in per_channel[1 if args.allocate else 0:]:     # other settings: the file's layer scales
        layer = {kind: scales.get(kind, ()) for kind in "kv"}
        codecs.update({f"{n}@{a:g}:{b:g}": Allocated(c, {**layer, **ch}, f"{n}@{a:g}:{b:g}")
                       for n, c in levels.items()})
    if args.edge_layers:        # the entropy-coded levels as the live path sent them before
        codecs.update({f"{n}+layer0": AllLayers(codecs[n]) for n in levels})
    result = evaluate(engine, windows, greedy, codecs, args)
    # Speed on long planes (the windows' KV end to end per layer: ≥ 1 MB each on a small model), as a
    # long prompt's per-layer chunk; per-call costs of short chunks are a separate matter.
    runs = [Run(engine, w[:args.prompt_len], args.new_tokens) for w in windows[:8]]
    planes = [(kind, np.concatenate([r.bits[kind][layer] for r in runs], axis=1), layer)
              for kind in "kv" for layer in range(engine.config.num_hidden_layers)]
    for r in runs:
        r.close()
    speeds = speed(planes, {"int8": CODECS["int8"], **codecs}, args.repeats, args.rope)
    rows = result["rows"]
    for name, r in rows.items():
        r.update(speeds[name])
        progress(f"{name}: {r}")
    reached = {}
    for tname, t in TARGETS.items():
        ok = [n for n, r in rows.items() if r["ratio_vs_bf16"] <= t["ratio_vs_bf16"]
              and r["ppl_increase"] <= t["ppl_increase"] and r["agreement"] >= t.get("agreement", 0)]
        reached[tname] = min(ok, key=lambda n: rows[n]["ratio_vs_bf16"]) if ok else None
    if args.sensitivity:
        extra["sensitivity"] = {"level": args.sensitivity, "mean_kl": sensitivity(
            engine, windows[:10], greedy[:10], codecs.get(args.sensitivity) or CODECS[args.sensitivity],
            engine.config.num_hidden_layers, args)}
        progress(f"sensitivity: {extra['sensitivity']}")
    png = RESULTS / f"{args.name}.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plotted = plot(rows, png, f"KV codecs on {model.name} ({len(windows)} × {args.prompt_len}-token prompts)")
    best = reached["ratio_0.15"] or reached["ratio_0.25"]
    emit(args.name, "smallest_ratio_meeting_target", rows[best]["ratio_vs_bf16"] if best else None,
         model=model.name, base_ppl=result["base_ppl"], prompts=len(windows), prompt_tokens=args.prompt_len,
         new_tokens=args.new_tokens, compute_dtype=args.dtype, rope_given=args.rope is not None, speed_int8_reference=speeds["int8"],
         layers=engine.config.num_hidden_layers, edge_layers=args.edge_layers,
         targets=TARGETS, reached=reached, codecs=rows, plot=str(png.relative_to(ROOT)) if plotted else None,
         **extra)


if __name__ == "__main__":
    main()
