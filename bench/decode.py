"""Decode throughput of the engine vs transformers `generate`, and bandwidth use at batch 1.

Default: the bundled model, 1/8/32/64 concurrent requests of 128 prompt + 128 new tokens,
greedy, token ids out (no detokenization on either side); our engine and transformers side by
side in the same run, in the same dtype; ratio per batch size. Both run in one process, so
process-wide settings (threads, the engine's heap settings from shared/node/malloc.py) apply to
transformers too. The headline is float32, the engine's CPU default; bfloat16 (the checkpoint's
own dtype) is measured and reported beside it.
`--synthetic`: a random-weight Llama of about 1 GB; batch-1 decode step time against the time
to read those bytes once at the memory bandwidth measured now (a large tensor copy).
`--penalties`: decode throughput of the bundled model with presence, frequency and repetition
penalties and a 16-entry logit_bias on every request, against the same requests without them,
interleaved in one run (greedy, fp32; target ≥ 0.9×), at batch sizes 1/8/32/64; tokens per wall
second and per CPU second of the process (the steadier one on a machine shared with other jobs).
`--breakdown`: where a decode step of the bundled model goes at one batch size (torch profiler,
operator self time grouped into matmuls, attention, KV gather/write and other operators; the rest
of the step's wall time, `between_ops`, is Python, dispatch and the profiler's own cost, which
makes a profiled step 10-20% slower than a plain one; with `--compile`, of the compiled step, its generated
kernels grouped by name), then unprofiled steps timed one by one (median
and minimum: on a machine shared with other jobs the minimum is the steadier figure). `--threads N` sets
torch's thread count first (default: torch's own).
`--idle-gaps`: the bundled model's batch-1 decode matmuls (its 17 weights merged as the engine holds
them, float32, one thread) run back to back, then with 10/20/50 us of busy-waiting Python between them (what a step's other operators and
interpreter work put between two matmuls), for the weight as stored ([out, in], `F.linear`), input-major
([in, out], `torch.mm`, what the engine uses for few rows) and oneDNN-packed; the matmul time alone, median
of 300 passes per setting, interleaved over 5 rounds (best round). Shows whether a step's matmuls find their
weights in cache: a gap that touches no memory still slows the next matmul where caches are shared or the
virtual CPU moves.
`--floor`: the engine's batch-1 step against the fewest eager torch operators that compute it
(bench/decode_floor.py), interleaved rounds: how much of a step is the engine's own work.
`--compiled`: whole engine steps of the bundled model eager against compiled (`--compile`), alternating in
one run at `--batches` (bench/decode_compiled.py): step times, tokens/s, speed-up, same tokens or not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from common import ROOT, emit, median_time, progress

import torch

from edgecore.shared.models.config import CacheConfig, EngineConfig, ModelConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.loader import build_model

MODEL = ROOT / "models" / "pydoc-llama"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def engine_tps(engine, prompts, new_tokens):
    # Token ids only, as transformers `generate` returns them (no incremental detokenization).
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    out = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert all(len(r["token_ids"]) == new_tokens for r in out)
    return len(prompts) * new_tokens / elapsed


def hf_tps(hf, prompts, new_tokens):
    ids = torch.tensor(prompts)
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / elapsed


def bench_bundled(batches, prompt_len, new_tokens, repeats, dtype_name):
    import transformers
    transformers.logging.set_verbosity_error()
    engine = LLMEngine.from_dir(MODEL, dtype_name, "cpu", CacheConfig(num_blocks=4096),
                                EngineConfig(max_num_batched_tokens=4096, max_num_seqs=256))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=DTYPES[dtype_name]).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        prompts = torch.randint(3, 2048, (b, prompt_len), generator=gen).tolist()
        engine_tps(engine, prompts[:1], 4)     # warm-up
        ours = statistics.median(engine_tps(engine, prompts, new_tokens) for _ in range(repeats))
        theirs = statistics.median(hf_tps(hf, prompts, new_tokens) for _ in range(repeats))
        rows.append({"batch": b, "edgecore_tok_s": round(ours, 1), "transformers_tok_s": round(theirs, 1),
                     "ratio": round(ours / theirs, 2)})
        progress(f"{dtype_name} batch {b}: edgecore {ours:.0f} tok/s, transformers {theirs:.0f} tok/s, "
                 f"{ours / theirs:.2f}x")
    return rows


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                 logit_bias={t: (-1.0) ** t for t in range(100, 116)})


def bench_penalties(batches, prompt_len, new_tokens, repeats) -> list[dict]:
    engine = LLMEngine.from_dir(MODEL, "fp32", "cpu", CacheConfig(num_blocks=4096),
                                EngineConfig(max_num_batched_tokens=4096, max_num_seqs=256))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        prompts = torch.randint(3, 2048, (b, prompt_len), generator=gen).tolist()
        plain = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False)
        penalized = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False,
                                   **PENALTIES)
        engine.generate(prompts[:1], [penalized])     # warm-up
        wall = {"plain": [], "penalized": []}
        cpu = {"plain": [], "penalized": []}
        for _ in range(repeats):                      # interleaved: drift on a shared machine hits both alike
            for name, params in (("plain", plain), ("penalized", penalized)):
                t, c = time.perf_counter(), time.process_time()
                engine.generate(prompts, params)
                wall[name].append(b * new_tokens / (time.perf_counter() - t))
                cpu[name].append(b * new_tokens / (time.process_time() - c))
        ours, theirs = statistics.median(wall["penalized"]), statistics.median(wall["plain"])
        cpu_ratio = statistics.median(cpu["penalized"]) / statistics.median(cpu["plain"])
        rows.append({"batch": b, "penalized_tok_s": round(ours, 1), "plain_tok_s": round(theirs, 1),
                     "ratio": round(ours / theirs, 3), "cpu_time_ratio": round(cpu_ratio, 3)})
        progress(f"batch {b}: with penalties {ours:.0f} tok/s, without {theirs:.0f} tok/s, {ours / theirs:.3f}x "
                 f"(per CPU second: {cpu_ratio:.3f}x)")
    return rows


def at_32(rows) -> float:
    return next((r["ratio"] for r in rows if r["batch"] == 32), rows[-1]["ratio"])


def synthetic_config() -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 10, "num_attention_heads": 32,
        "num_key_value_heads": 4, "max_position_embeddings": 2048, "tie_word_embeddings": False})


def copy_bandwidth(nbytes: int) -> float:
    """Memory bandwidth from copying `nbytes` (a copy reads and writes every byte); buffers freed after."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = median_time(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / seconds


def bench_synthetic(dtype_name, steps):
    dtype = DTYPES[dtype_name]
    config = synthetic_config()
    progress(f"building a random {dtype_name} model")
    model = build_model(config, dtype, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    # Bytes a decode step must read: every weight except the embedding table (one row is read).
    read_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if "embed_tokens" not in n)
    engine = LLMEngine(model, config, None, CacheConfig(num_blocks=64), EngineConfig())
    progress(f"weights read per step: {read_bytes / 1e9:.2f} GB; measuring memory bandwidth")
    bandwidth = copy_bandwidth(read_bytes)
    engine.add_request("r", list(range(16)), SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    engine.step()                                  # prefill
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    step = statistics.median(times[2:])
    ideal = read_bytes / bandwidth
    progress(f"bandwidth {bandwidth / 1e9:.1f} GB/s, step {step * 1e3:.1f} ms, ideal {ideal * 1e3:.1f} ms")
    return {"dtype": dtype_name, "weight_bytes": read_bytes, "bandwidth_GBps": round(bandwidth / 1e9, 2),
            "step_ms": round(step * 1e3, 2), "ideal_ms": round(ideal * 1e3, 2),
            "fraction": round(ideal / step, 3)}


# Compiled steps (--compile): inductor's kernels are named after what they fuse (`gemm` for its GEMM template;
# the attention kernel fuses the cache write, the gather, the softmax (written out: `amax`) and both reductions).
OP_GROUPS = {"matmul": ("linear", "mm", "gemm"), "attention": ("scaled_dot_product", "softmax", "amax"),  # "mm": mm, addmm, bmm
             "kv_gather_write": ("index_select", "index_copy")}


def bench_breakdown(batch: int, dtype_name: str, steps: int = 30, compiled: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile
    if compiled:        # each generated kernel a profiler event (read when inductor's config is first imported)
        # Partial: with it, torch 2.13 writes a padded row count into a C++ name and the wide module's CPP GEMM
        # candidates fail to compile (logged as errors, skipped), so its matmul choices may differ from serving.
        os.environ["TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"] = "1"
    engine = LLMEngine.from_dir(MODEL, dtype_name, "cpu", CacheConfig(num_blocks=4096),
                                EngineConfig(max_num_batched_tokens=4096, max_num_seqs=256, compile_decode=compiled))
    engine.compile_decode()
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=2 * steps + 40, temperature=0, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(torch.randint(3, 2048, (batch, 128), generator=gen).tolist()):
        engine.add_request(str(i), prompt, params)
    for _ in range(10):                           # prefill, then a few decode steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t) / steps
    plain = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t)
    groups = dict.fromkeys([*OP_GROUPS, "other_ops"], 0.0)
    for event in prof.key_averages():
        name = event.key.split("::")[-1]
        group = next((g for g, keys in OP_GROUPS.items() if any(k in name for k in keys)), "other_ops")
        groups[group] += event.self_cpu_time_total / 1e6 / steps
    groups["between_ops"] = max(0.0, wall - sum(groups.values()))
    progress(f"batch {batch} {dtype_name}: step {wall * 1e3:.2f} ms (under the profiler): " +
             ", ".join(f"{g} {v * 1e3:.2f} ms" for g, v in groups.items()) +
             f"; unprofiled median {statistics.median(plain) * 1e3:.2f} ms, min {min(plain) * 1e3:.2f} ms")
    return {"batch": batch, "dtype": dtype_name, "threads": torch.get_num_threads(), "compiled": compiled,
            "step_ms_profiled": round(wall * 1e3, 3),
            "step_ms_median": round(statistics.median(plain) * 1e3, 3), "step_ms_min": round(min(plain) * 1e3, 3),
            "ms_per_step": {g: round(v * 1e3, 3) for g, v in groups.items()},
            "share": {g: round(v / wall, 3) for g, v in groups.items()}}


def bench_idle_gaps(gaps_us=(0, 10, 20, 50), passes: int = 300, rounds: int = 5) -> dict:
    import torch.nn.functional as F
    from safetensors.torch import load_file
    torch.set_num_threads(1)
    sd = {k: v.float() for k, v in load_file(str(MODEL / "model.safetensors")).items()}
    weights = []            # merged as the engine holds them: qkv, o, gate_up, down per layer; the tied LM head
    for i in range(json.loads((MODEL / "config.json").read_text())["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights += [torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]), sd[p + "self_attn.o_proj.weight"],
                    torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]),
                    sd[p + "mlp.down_proj.weight"]]
    weights = [w.contiguous() for w in weights + [sd["model.embed_tokens.weight"]]]
    layouts = {"out_in_linear": [(lambda x, w=w: F.linear(x, w)) for w in weights],
               "in_out_mm": [(lambda x, w=w.t().contiguous(): torch.mm(x, w)) for w in weights],
               "onednn_packed": [(lambda x, w=torch.ops.mkldnn._reorder_linear_weight(w):
                                  torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")) for w in weights]}
    inputs = [torch.randn(1, w.shape[1]) for w in weights]

    def one_pass(calls, gap: float) -> float:
        spent = 0.0
        for call, x in zip(calls, inputs):
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                pass
            t = time.perf_counter()
            call(x)
            spent += time.perf_counter() - t
        return spent

    best: dict = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for layout, calls in layouts.items():
                for gap in gaps_us:
                    ms = statistics.median(one_pass(calls, gap / 1e6) for _ in range(passes)) * 1e3
                    key = (layout, gap)
                    best[key] = min(best.get(key, ms), ms)
    rows = {layout: {f"gap_{g}us_ms": round(best[(layout, g)], 3) for g in gaps_us} for layout in layouts}
    progress("; ".join(f"{layout}: " + ", ".join(f"{g} us gap {best[(layout, g)]:.2f} ms" for g in gaps_us)
                       for layout in layouts))
    return {"matmuls": len(weights), "weight_mb": round(sum(w.numel() * 4 for w in weights) / 2**20, 2),
            "threads": 1, "passes": passes, "rounds": rounds, "ms_per_pass": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", action="store_true", help="batch-1 bandwidth test on a ~1 GB random model")
    ap.add_argument("--breakdown", type=int, metavar="BATCH",
                    help="profile decode steps at this batch size and group their time (no comparison)")
    ap.add_argument("--idle-gaps", action="store_true",
                    help="batch-1 matmul time of the bundled model's weights back to back and with idle gaps")
    ap.add_argument("--floor", action="store_true",
                    help="batch-1 engine step against a hand-written eager step of the same model (bench/decode_floor.py)")
    ap.add_argument("--compile", action="store_true", help="--breakdown: of the compiled step (--compile)")
    ap.add_argument("--compiled", action="store_true",
                    help="engine steps eager against compiled (--compile) at --batches, same run (bench/decode_compiled.py)")
    ap.add_argument("--penalties", action="store_true",
                    help="throughput with penalties and logit_bias against without (same run, no transformers)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arch", choices=["llama", "moe"], default="llama",
                    help="moe: a random ~200 MB Mixtral-shaped model and its MoE layer (bench/decode_moe.py)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("--dtype", choices=sorted(DTYPES),
                    help="synthetic: the weights' dtype (bf16); bundled: one dtype only (else fp32 and bf16)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.penalties:
        rows = bench_penalties([int(b) for b in args.batches.split(",")], args.prompt_len, args.new_tokens,
                               args.repeats)
        emit("decode_penalties", "min_ratio_with_penalties", min(r["ratio"] for r in rows), target=0.9, rows=rows,
             penalties={k: v for k, v in PENALTIES.items() if k != "logit_bias"}, logit_bias_entries=16,
             prompt_tokens=args.prompt_len, new_tokens=args.new_tokens, threads=torch.get_num_threads())
        return
    if args.compiled:
        from decode_compiled import run as compiled
        r = compiled([int(b) for b in args.batches.split(",")], args.prompt_len, 50, max(args.repeats, 4))
        emit("decode_compiled", "speedup_batch1", r["rows"][0]["speedup"], **r)
        return
    if args.floor:
        from decode_floor import run as floor
        r = floor(args.prompt_len, args.new_tokens, max(args.repeats, 5))
        emit("decode_floor", "engine_over_eager_floor_batch1", r["engine_over_floor"], **r)
        return
    if args.idle_gaps:
        r = bench_idle_gaps()
        emit("decode_idle_gaps", "slowdown_in_out_mm_at_50us_gap",
             round(r["ms_per_pass"]["in_out_mm"]["gap_50us_ms"] / r["ms_per_pass"]["in_out_mm"]["gap_0us_ms"], 2), **r)
        return
    if args.breakdown:
        r = bench_breakdown(args.breakdown, args.dtype or "fp32", compiled=args.compile)
        emit("decode_breakdown", "matmul_share_of_decode_step", r["share"]["matmul"], **r)
        return
    if args.synthetic:
        r = bench_synthetic(args.dtype or "bf16", 40)
        emit("decode_synthetic", "fraction_of_memory_bandwidth", r["fraction"], target=0.5, **r)
        return
    batches = [int(b) for b in args.batches.split(",")]
    if args.arch == "moe":
        from decode_moe import run
        run([b for b in batches if b <= 32], args.prompt_len, args.new_tokens, args.repeats, engine_tps, hf_tps)
        return
    by_dtype = {d: bench_bundled(batches, args.prompt_len, args.new_tokens, args.repeats, d)
                for d in ([args.dtype] if args.dtype else ["fp32", "bf16"])}
    headline = "fp32" if "fp32" in by_dtype else args.dtype
    emit("decode", "ratio_vs_transformers_at_32", at_32(by_dtype[headline]), target=3.0, dtype=headline,
         rows=by_dtype[headline], ratio_at_32_by_dtype={d: at_32(r) for d, r in by_dtype.items()},
         rows_by_dtype=by_dtype, prompt_tokens=args.prompt_len, new_tokens=args.new_tokens,
         threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
