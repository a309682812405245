"""HTTP serving under load: N streaming clients against edge + core on loopback, bundled model.

For `--duration` seconds, `--clients` workers each send streaming completions
back to back (held-out prompts of 48–200 tokens, `--max-tokens` new tokens,
greedy, ignore_eos). Reported: requests/s, TTFT p50/p99, inter-token latency
p50/p99, errors (must be 0), and generated tokens/s. In the same run the same
requests go through the engine in-process (same concurrency) to give the
engine's own tokens/s; the ratio HTTP / engine is the metric (target ≥ 0.85).
CPU speed here drifts by 10-20% within minutes, so this runs in rounds
(HTTP load, then the engine alone on that round's requests, nodes idle) and
reports the median round's ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time

from common import ROOT, emit, engine_tokens_per_s, progress

from tests.e2e.procs import start_core, start_edge  # noqa: E402  (process helpers shared with the tests)


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def client_load(port: int, prompts, clients: int, duration: float, max_tokens: int):
    import aiohttp
    ttft, itl, errors, done = [], [], 0, []
    stop_at = time.perf_counter() + duration
    rng = random.Random(0)

    async def worker(session):
        nonlocal errors
        while time.perf_counter() < stop_at:
            prompt = rng.choice(prompts)
            t0 = time.perf_counter()
            last, tokens = None, 0
            try:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={
                        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}) as resp:
                    if resp.status != 200:
                        errors += 1
                        continue
                    # The load generator shares the CPUs with the nodes, so it is frugal: it reads
                    # whatever arrived, splits it into events, and parses only the chunks it needs (usage,
                    # errors); a token chunk is recognised by its "choices":[{ prefix.
                    pending, failed = b"", False
                    async for data in resp.content.iter_any():
                        now = time.perf_counter()
                        *events, pending = (pending + data).split(b"\n\n")
                        for event in events:
                            if not event.startswith(b"data: {"):
                                continue
                            if b'"choices":[{' not in event:
                                chunk = json.loads(event[6:])
                                if "error" in chunk:
                                    failed = True
                                elif chunk.get("usage"):
                                    tokens = chunk["usage"]["completion_tokens"]
                                continue
                            if last is None:
                                ttft.append(now - t0)
                            else:
                                itl.append(now - last)
                            last = now
                        if failed:
                            errors += 1
                            break
                done.append((prompt, tokens))
            except aiohttp.ClientError:
                errors += 1

    t = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients + 4)) as session:
        await asyncio.gather(*(worker(session) for _ in range(clients)))
    return ttft, itl, errors, done, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3,
                    help="HTTP load then the engine alone, this many times; the ratio is the median round's")
    ap.add_argument("--no-core", action="store_true", help="edge only (local prefill): HTTP overhead alone")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the nodes and of the baseline engine (on 2 cores the load "
                         "generator needs the other one)")
    args = ap.parse_args()
    from edgecore.shared.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(ROOT / "models" / "pydoc-llama")
    ids = tok.encode((ROOT / "models" / "pydoc-llama" / "heldout.txt").read_text())
    rng = random.Random(1)
    prompts = []
    for _ in range(200):
        n = rng.randint(48, 200)
        start = rng.randint(0, len(ids) - n)
        prompts.append(ids[start:start + n])
    with tempfile.TemporaryDirectory() as tmp:
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("bench")
        os.environ["EDGECORE_THREADS"] = str(args.threads)
        import torch
        torch.set_num_threads(args.threads)
        core = None
        if args.no_core:
            edge, http = start_edge()
        else:
            core, port, _ = start_core(secret)
            edge, http = start_edge(cores=[port], secret_file=secret)
        try:
            rounds = []
            for r in range(args.rounds):
                progress(f"round {r + 1}/{args.rounds}: {args.clients} streaming clients for {args.duration:.0f} s")
                ttft, itl, errors, done, elapsed = asyncio.run(
                    client_load(http, prompts, args.clients, args.duration, args.max_tokens))
                http_tps = sum(t for _, t in done) / elapsed
                progress(f"HTTP: {len(done)} requests, {http_tps:.0f} tok/s, errors {errors}; the engine alone "
                         "on the same requests (the nodes stay idle meanwhile)")
                base = engine_tokens_per_s([p for p, _ in done], args.max_tokens, max_num_seqs=args.clients)
                progress(f"engine: {base:.0f} tok/s, ratio {http_tps / base:.3f}")
                rounds.append({"ttft": ttft, "itl": itl, "errors": errors, "requests": len(done),
                               "elapsed": elapsed, "http_tps": http_tps, "engine_tps": base})
        finally:
            edge.stop()
            if core:
                core.stop()
    ratios = [r["http_tps"] / r["engine_tps"] for r in rounds]
    middle = rounds[ratios.index(statistics.median_low(ratios))]
    ttft = [t for r in rounds for t in r["ttft"]]
    itl = [t for r in rounds for t in r["itl"]]
    emit("serve", "http_vs_engine_tokens_per_s", round(statistics.median(ratios), 3), target=0.85,
         path="edge only" if args.no_core else "edge + core", round_ratios=[round(x, 3) for x in ratios],
         clients=args.clients, duration_s=args.duration, rounds=args.rounds, torch_threads=args.threads,
         requests=sum(r["requests"] for r in rounds),
         requests_per_s=round(sum(r["requests"] for r in rounds) / sum(r["elapsed"] for r in rounds), 2),
         errors=sum(r["errors"] for r in rounds),
         ttft_ms={"p50": round(pct(ttft, 0.5) * 1e3, 1), "p99": round(pct(ttft, 0.99) * 1e3, 1)},
         itl_ms={"p50": round(pct(itl, 0.5) * 1e3, 2), "p99": round(pct(itl, 0.99) * 1e3, 2)},
         http_tokens_per_s=round(middle["http_tps"], 1), engine_tokens_per_s=round(middle["engine_tps"], 1))


if __name__ == "__main__":
    main()
