"""What decode handover costs: the core's extra work, and the edge's recompute of the core's tokens.

Part 1, the core (`core_cost`): one core process with the bundled model behind
a userspace relay (`--delay-ms` 20 ms one way), once per `--mbit` link (50 and
10 Mbit/s: at 50 the layer-wise stream keeps up and the core decodes about one
token per request; at 10 the KV of concurrent requests queues on the link and
the core decodes for the edges up to its bound). Two in-process edges reach it
through the relay, one with handover (64 tokens) and one without (the old
mode). Rounds alternate between them (on, off, on, off, ...): each round sends
`--concurrent` requests at once, each a fresh `--prompt-tokens`-token prompt
(no prefix-cache hits) asking for `--max-tokens` tokens. Per round: the core's
prefill throughput (prompt tokens of the round / time from the round's start
until the core's own prompt-token counter, polled every 50 ms, has counted
every prompt of the round: the core's prefills plus what its decoding for the
edges took from them), and from the core's /stats
the tokens it decoded per handover request (each is one decode step of its
batch that the request took part in). Medians over rounds; on/off as a ratio.

Part 2, the edge (`recompute`): when the edge takes over after k core tokens
it computes their KV itself, as one k-token chunk at the end of the context
(shared/engine/engine.py `take_over`), instead of the core sending that KV.
The random 8k-context model of bench/ttft.py, in process: a `context`-token
prompt is prefilled once (prefix cache), then for k = 1, 5, 30 a request with
k fresh tokens after it: its first step computes exactly the k-token chunk
(timed), its next steps are ordinary decode steps at the same context (timed,
the reference). Against it: the bytes the core would send instead (k x the
model's raw KV bytes per token) and their time on bench/ttft.py's 200 Mbit/s
link; the same arithmetic for a Llama-3-8B-shaped KV (128 KiB per token).

Prints one JSON line, writes bench/results/handover.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, progress

import torch

from edgecore.deploy.wan_relay import LinkSpec, WanRelay
from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.shared.models.config import CacheConfig, EngineConfig, ModelConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.e2e.procs import get_json, start_core

BUNDLED = ROOT / "models" / "pydoc-llama"
LLAMA3_8B_KV_BYTES = 32 * 2 * 8 * 128 * 2      # layers x (K, V) x KV heads x head_dim x bf16


def _core_prompt_tokens(http: int) -> float:
    """The core's `edgecore:core_prompt_tokens_total` (counted as each prefill ends)."""
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("edgecore:core_prompt_tokens_total"))


async def _round(edge: EdgeNode, prompts: list[list[int]], max_tokens: int, tag: str, http: int) -> dict:
    """All prompts at once. The core's prefill makespan: from the start until its prompt-token counter
    (polled every 50 ms) has counted every prompt; also the seconds to the last first and last token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    before = await asyncio.to_thread(_core_prompt_tokens, http)
    start = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> tuple[float, float]:
        first = None
        async for _ in edge.generate(f"{tag}-{i}", prompt, params):
            first = first or time.perf_counter()
        return first - start, time.perf_counter() - start

    async def prefilled() -> float:
        goal = before + sum(len(p) for p in prompts)
        while await asyncio.to_thread(_core_prompt_tokens, http) < goal:
            await asyncio.sleep(0.05)
        return time.perf_counter() - start

    makespan, *times = await asyncio.gather(prefilled(), *(one(i, p) for i, p in enumerate(prompts)))
    return {"core_prefill_makespan_s": makespan, "last_first_token_s": max(t[0] for t in times),
            "last_token_s": max(t[1] for t in times)}


async def core_cost(args, mbit: float) -> dict:
    secret_file = Path(tempfile.mkdtemp(prefix="edgecore-bench-")) / "secret"
    secret_file.write_bytes(b"handover-bench")
    core, port, http = start_core(str(secret_file), "--model", str(BUNDLED))
    relay = WanRelay(LinkSpec(delay_ms=args.delay_ms, bandwidth_mbit=mbit))
    relay_port = await relay.start(("127.0.0.1", 0), ("127.0.0.1", port))
    cache = CacheConfig(num_blocks=2048)
    edges = {mode: EdgeNode(EdgeConfig(str(BUNDLED), cores=[("127.0.0.1", relay_port)], secret=b"handover-bench",
                                         local_prefill_below=0, transfer_timeout=300, cache=cache,
                                         handover_tokens=64 if mode == "on" else 0, name=f"edge-{mode}"))
             for mode in ("on", "off")}
    for edge in edges.values():
        await edge.start()
    gen = torch.Generator().manual_seed(3)
    rounds: dict[str, list[dict]] = {"on": [], "off": []}
    try:
        for r in range(args.rounds + 1):                     # round 0 of each mode: warm-up, not counted
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                prompts = [torch.randint(5, 2000, (args.prompt_tokens,), generator=gen).tolist()
                           for _ in range(args.concurrent)]
                before = get_json(f"http://127.0.0.1:{http}/stats")["handover"]
                res = await _round(edges[mode], prompts, args.max_tokens, f"{mode}-{r}", http)
                await asyncio.sleep(0.3)                     # the core's DecodeStops and Acks settle
                after = get_json(f"http://127.0.0.1:{http}/stats")["handover"]
                res["prefill_tokens_per_s"] = args.concurrent * args.prompt_tokens / res["core_prefill_makespan_s"]
                res["decode_requests"] = after["decode_requests"] - before["decode_requests"]
                res["decoded_tokens"] = after["decoded_tokens"] - before["decoded_tokens"]
                res["refused"] = after["refused"] - before["refused"]
                progress(f"{mbit} Mbit/s, round {r} handover {mode}: {res}")
                if r:
                    rounds[mode].append(res)
    finally:
        for edge in edges.values():
            await edge.stop()
        await relay.stop()
        core.stop()
    on, off = rounds["on"], rounds["off"]
    med = lambda rows, k: statistics.median(x[k] for x in rows)          # noqa: E731
    decode_requests = sum(x["decode_requests"] for x in on)
    return {
        "prefill_tokens_per_s": {"handover_on": round(med(on, "prefill_tokens_per_s")),
                                 "handover_off": round(med(off, "prefill_tokens_per_s"))},
        "prefill_throughput_on_over_off": round(med(on, "prefill_tokens_per_s") / med(off, "prefill_tokens_per_s"), 3),
        "round_seconds_to_last_first_token": {"handover_on": round(med(on, "last_first_token_s"), 2),
                                              "handover_off": round(med(off, "last_first_token_s"), 2)},
        "round_seconds_to_last_token": {"handover_on": round(med(on, "last_token_s"), 2),
                                        "handover_off": round(med(off, "last_token_s"), 2)},
        "core_decode_steps_per_handover_request": round(sum(x["decoded_tokens"] for x in on) /
                                                        max(1, decode_requests), 2),
        "handover_requests": decode_requests, "refused": sum(x["refused"] for x in on),
        "off_mode_decode_requests": sum(x["decode_requests"] for x in off),       # must be 0
        "rounds_per_mode": args.rounds, "concurrent": args.concurrent, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "link_mbit": mbit, "delay_ms": args.delay_ms, "model": "pydoc-llama",
    }


def _timed_steps(engine: LLMEngine, rid: str, prompt: list[int], decode_steps: int) -> tuple[float, list[float]]:
    """Run one request alone: (seconds of its first step, seconds of each following decode step)."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1 + decode_steps, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[0], times[1:]


def recompute(args, model_dir: Path) -> dict:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cache = CacheConfig(num_blocks=(8192 + 256) // 16 * 2)
    engine = LLMEngine.from_dir(model_dir, "bf16", "cpu", cache, EngineConfig(max_num_batched_tokens=1024,
                                                                              max_num_seqs=4))
    bytes_per_token = ModelConfig.from_dir(model_dir).kv_bytes_per_token(2)
    gen = torch.Generator().manual_seed(4)
    rows = {}
    for context in args.contexts:
        prefix = torch.randint(5, 4000, (context,), generator=gen).tolist()
        progress(f"prefilling a {context}-token context")
        engine.generate([prefix], SamplingParams(max_tokens=1, temperature=0))    # now in the prefix cache
        row = {}
        for k in (1, 5, 30):
            chunks, steps = [], []
            for r in range(args.repeats):
                extra = torch.randint(5, 4000, (k,), generator=gen).tolist()
                if engine.cached_prefix(prefix + extra) != context:     # else the first step is not a k-token chunk
                    raise RuntimeError(f"the {context}-token context is not in the prefix cache")
                first, decode = _timed_steps(engine, f"k{k}-{context}-{r}", prefix + extra, 3)
                chunks.append(first)
                steps.extend(decode)
            chunk_ms, step_ms = statistics.median(chunks) * 1e3, statistics.median(steps) * 1e3
            wire = k * bytes_per_token
            row[f"k={k}"] = {
                "chunk_ms": round(chunk_ms, 2), "decode_step_ms": round(step_ms, 2),
                "recompute_extra_ms": round(chunk_ms - step_ms, 2), "chunk_over_step": round(chunk_ms / step_ms, 3),
                "send_kv_bytes": wire, "send_kv_ms_at_200mbit": round(wire * 8 / 200e6 * 1e3, 2),
                "send_kv_bytes_llama3_8b": k * LLAMA3_8B_KV_BYTES,
                "send_kv_ms_at_200mbit_llama3_8b": round(k * LLAMA3_8B_KV_BYTES * 8 / 200e6 * 1e3, 2)}
            progress(f"context {context}, k={k}: {row[f'k={k}']}")
        rows[str(context)] = row
    return {"rows": rows, "kv_bytes_per_token": bytes_per_token, "dtype": "bf16", "device": "cpu",
            "threads": torch.get_num_threads(), "repeats": args.repeats}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbit", default="50,10", help="links of the core-cost part (Mbit/s), one run each")
    ap.add_argument("--delay-ms", type=float, default=20)
    ap.add_argument("--rounds", type=int, default=4, help="counted rounds per mode (after one warm-up each)")
    ap.add_argument("--concurrent", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--contexts", default="2048,8144", help="recompute: context lengths (multiples of 16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-core", action="store_true")
    ap.add_argument("--skip-recompute", action="store_true")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    core = None if args.skip_core else {f"{mbit:g}_mbit": asyncio.run(core_cost(args, mbit))
                                        for mbit in (float(x) for x in args.mbit.split(","))}
    rec = None
    if not args.skip_recompute:
        from ttft import write_model
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / "random-8k"
            write_model(model_dir)
            rec = recompute(args, model_dir)
    slowest = core and core[min(core, key=lambda k: float(k.split("_")[0]))]
    emit("handover", "prefill_throughput_on_over_off_slowest_link",
         slowest and slowest["prefill_throughput_on_over_off"],
         core_cost=core, recompute=rec,
         note="shared 2-core CPU machine under other jobs' load: compare numbers of one run, not across runs")


if __name__ == "__main__":
    main()
