"""Resident memory of an engine under sustained unique traffic, with and without a KV resident bound
(`--kv-resident-memory`): the process's RSS and the KV pool's touched part over time.

Two child processes (this script with `--child`), one per configuration, run at the same time, one torch
thread each: an in-process `LLMEngine` on the bundled model (fp32, CPU, `--kv-cache-memory` budget) kept
busy for `--seconds` with `--concurrency` requests in flight, each a prompt of random token ids (unique; a
`--shared-fraction` of them start with one of four fixed 128-token prefixes, so the prefix cache has
something to hit) and `--max-tokens` generated tokens. Every `--interval` seconds a child samples VmRSS
(/proc/self/status), the pool's touched bytes (blocks ever handed out × block bytes: its resident part on
CPU), glibc's heap (mallinfo2: bytes in use, bytes the heap holds) and the count of live Python objects.
The result: per configuration the curves (t, rss_mb, pool_touched_mb), decimated, and least-squares slopes
over the last half of the run of RSS, of the pool and of the rest (RSS − pool), in MB/s.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import time

from common import ROOT, emit, progress

MODEL = ROOT / "models" / "pydoc-llama"
CONFIGS = ("unbounded", "bounded")


def status_kib(*keys: str) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in keys:
                out[name] = int(line.split()[1])
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_mb() -> tuple[float, float] | None:
    """glibc's malloc: (bytes in use, bytes held: arenas + mmapped chunks) in MB; None without mallinfo2."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    m = fn()
    return (m.uordblks + m.hblkhd) / 1e6, (m.arena + m.hblkhd) / 1e6


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over t."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else 0.0


def decimate(samples: list, keep: int) -> list:
    if len(samples) <= keep:
        return samples
    step = (len(samples) - 1) / (keep - 1)
    return [samples[round(i * step)] for i in range(keep)]


def child(args: argparse.Namespace) -> dict:
    import torch

    from edgecore.shared.node.cli import kv_cache_config
    from edgecore.shared.models.config import EngineConfig, ModelConfig
    from edgecore.shared.engine.engine import LLMEngine
    from edgecore.shared.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    config = ModelConfig.from_dir(MODEL)
    bound = args.resident if args.child == "bounded" else None
    cache, kv_line = kv_cache_config(argparse.Namespace(kv_cache_memory=args.budget, kv_blocks=None,
                                                        kv_resident_memory=bound), config, 4)
    engine = LLMEngine.from_dir(MODEL, "fp32", "cpu", cache, EngineConfig())
    bm = engine.block_manager
    assert bm.resident_blocks == cache.resident_blocks, "the engine must take the bound from its CacheConfig"
    rng = random.Random(args.seed)
    vocab = config.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(4)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, detokenize=False)

    def prompt() -> list[int]:
        n = rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2)
        head = rng.choice(prefixes) if rng.random() < args.shared_fraction else []
        return head + [rng.randrange(3, vocab) for _ in range(n)]

    samples: list[dict] = []
    done = tokens = 0
    live: set[str] = set()
    start = time.monotonic()
    next_sample = start
    while True:
        now = time.monotonic()
        if now >= next_sample:
            rss = status_kib("VmRSS", "RssAnon", "RssFile")
            heap = heap_mb()
            samples.append({"t": round(now - start, 1), "rss_mb": round(rss["VmRSS"] / 1024 * 1.048576, 1),
                            "anon_mb": round(rss["RssAnon"] / 1024 * 1.048576, 1),
                            "pool_touched_mb": round(bm.touched * engine.pool.block_bytes / 1e6, 1),
                            "heap_used_mb": round(heap[0], 1) if heap else None,
                            "heap_held_mb": round(heap[1], 1) if heap else None,
                            "objects": len(gc.get_objects()), "requests": done,
                            "cached_blocks": len(bm.evictable), "engine_requests": len(engine.requests)})
            next_sample += args.interval
            if now - start >= args.seconds:
                break
        while len(live) < args.concurrency:
            rid = f"r{done + len(live)}-{rng.random()}"
            engine.add_request(rid, prompt(), params)
            live.add(rid)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                done += 1
                tokens += out.num_prompt_tokens + out.num_output_tokens
    return {"config": args.child, "kv": kv_line, "resident_blocks": bm.resident_blocks, "blocks": len(bm.blocks),
            "block_bytes": engine.pool.block_bytes,
            "requests": done, "tokens": tokens, "prefix_hit_rate": round(bm.hits / max(1, bm.queries), 4), "samples": samples}


def summarize(result: dict, keep: int) -> dict:
    samples = result.pop("samples")
    end = samples[-1]["t"]
    half = [s for s in samples if s["t"] >= end / 2]
    first, last = samples[0], samples[-1]

    def rate(key) -> float:
        return round(slope([(s["t"], key(s)) for s in half]), 4)

    result.update(
        seconds=end,
        rss_mb_start=first["rss_mb"], rss_mb_end=last["rss_mb"], rss_mb_peak=max(s["rss_mb"] for s in samples),
        pool_touched_mb_end=last["pool_touched_mb"],
        rest_mb_start=round(first["rss_mb"] - first["pool_touched_mb"], 1),
        rest_mb_end=round(last["rss_mb"] - last["pool_touched_mb"], 1),
        heap_used_mb_end=last["heap_used_mb"], heap_held_mb_end=last["heap_held_mb"],
        objects_start=first["objects"], objects_end=last["objects"],
        slope_last_half_mb_per_s={"rss": rate(lambda s: s["rss_mb"]), "pool": rate(lambda s: s["pool_touched_mb"]),
                                  "rest": rate(lambda s: s["rss_mb"] - s["pool_touched_mb"]),
                                  "heap_used": rate(lambda s: s["heap_used_mb"] or 0.0),
                                  "objects_per_s": rate(lambda s: s["objects"])},
        curve=[(s["t"], s["rss_mb"], s["pool_touched_mb"]) for s in decimate(samples, keep)],
        curve_rest=[(s["t"], round(s["rss_mb"] - s["pool_touched_mb"], 1), s["heap_used_mb"], s["heap_held_mb"])
                    for s in decimate(samples, keep)])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600, help="how long each configuration runs (default 600)")
    p.add_argument("--budget", default="2GiB", help="--kv-cache-memory of both (default 2GiB, the nodes' default)")
    p.add_argument("--resident", default="64MiB", help="--kv-resident-memory of the bounded one (default 64MiB)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="mean unique prompt length (default 256)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    p.add_argument("--shared-fraction", type=float, default=0.25,
                   help="share of prompts that start with one of 4 fixed 128-token prefixes (default 0.25)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--keep", type=int, default=41, help="samples kept per curve in the result (default 41)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential", action="store_true", help="one configuration after the other, not at once")
    p.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    argv = [a for a in sys.argv[1:] if a != "--sequential"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = {}
    procs = {}
    for name in CONFIGS:
        progress(f"{name}: {args.seconds:g} s of unique traffic")
        procs[name] = subprocess.Popen([sys.executable, __file__, *argv, "--child", name], stdout=subprocess.PIPE,
                                       text=True, env=env)
        if args.sequential:
            results[name] = json.loads(procs[name].communicate()[0])
    for name, proc in procs.items():
        if name not in results:
            out, _ = proc.communicate()
            if proc.returncode:
                sys.exit(f"{name} failed ({proc.returncode})")
            results[name] = json.loads(out)
    summary = {name: summarize(r, args.keep) for name, r in results.items()}
    emit("kv_resident", "rss_mb_end_bounded", summary["bounded"]["rss_mb_end"],
         unit="MB", seconds=args.seconds, budget=args.budget, resident=args.resident, concurrency=args.concurrency,
         prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, shared_fraction=args.shared_fraction,
         sequential=args.sequential, **summary)


if __name__ == "__main__":
    main()
