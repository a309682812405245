"""Tenants on one edge: a noisy neighbour cannot hurt a quiet tenant, and contended shares follow the weights.

One edge (`edgecore edge --tenants FILE`, the bundled model, prefills at the edge) and three phases:
1. `quiet alone`: tenant `quiet` sends Poisson arrivals at `--quiet-rate` requests/s (streamed, TTFT timed).
2. `quiet + noisy`: the same, while tenant `noisy`, whose quota is `--noisy-quota` requests/s
   (`requests_per_minute`), sends at 10× its quota: the quiet tenant's TTFT p99 against phase 1 (target
   ≤ 1.2×) and the noisy one's 429s (each with Retry-After).
3. `shares`: tenants `a` and `b`, equal weights and no limits, each with `--clients` closed-loop clients
   (together more sequences than the engine's batch holds): each one's share of the generated tokens
   (target 50% ± 5%); then again with weights 3 and 1 (expected 75% / 25%).
Prints one JSON line and writes bench/results/tenants.json. (Multi-LoRA throughput is bench/lora.py's row.)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from common import ROOT, emit, progress

MODEL = ROOT / "models" / "pydoc-llama"


def tenants_file(path: Path, keys: dict[str, str], noisy_quota: float, weights: dict[str, int]) -> None:
    blocks = []
    for name, key in keys.items():
        extra = f"requests_per_minute = {round(noisy_quota * 60)}\n" if name == "noisy" else ""
        blocks.append(f'[[tenant]]\nname = "{name}"\napi_keys = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n'
                      f"weight = {weights.get(name, 1)}\n{extra}")
    path.write_text("\n".join(blocks))


class Edge:
    def __init__(self, tenants: Path, port: int):
        self.port = port
        self.proc = subprocess.Popen([sys.executable, "-m", "edgecore", "edge", "--model", str(MODEL), "--listen",
                                      f"127.0.0.1:{port}", "--tenants", str(tenants)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the edge did not start") from None
                time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def request(session: aiohttp.ClientSession, port: int, key: str, prompt: list[int],
                  max_tokens: int) -> tuple[int, float | None, int, bool]:
    """(HTTP status, TTFT s or None, completion tokens, whether a 429 carried Retry-After)."""
    t0 = time.perf_counter()
    body = {"model": "pydoc-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            await resp.read()
            return resp.status, None, 0, "Retry-After" in resp.headers
        ttft, tokens, pending = None, 0, b""
        async for data in resp.content.iter_any():
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                if ttft is None and b'"choices":[{' in event:
                    ttft = time.perf_counter() - t0
                elif event.startswith(b"data: {") and b'"usage"' in event:
                    tokens = json.loads(event[6:])["usage"]["completion_tokens"]
        return 200, ttft, tokens, False


async def poisson(session, port: int, key: str, rate: float, seconds: float, prompts, max_tokens: int, seed: int):
    rng, tasks = random.Random(seed), []
    end, at = time.perf_counter() + seconds, time.perf_counter()
    while True:
        at += rng.expovariate(rate)
        if at > end:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(request(session, port, key, rng.choice(prompts), max_tokens)))
    return await asyncio.gather(*tasks)


async def closed(session, port: int, key: str, clients: int, seconds: float, prompts, max_tokens: int,
                 seed: int) -> int:
    """Generated tokens of `clients` closed-loop clients over `seconds` (requests still running at the end are
    counted from their usage when they finish, so both tenants are measured over the same window)."""
    rng, end, total = random.Random(seed), time.perf_counter() + seconds, 0

    async def client() -> None:
        nonlocal total
        while time.perf_counter() < end:
            status, _, tokens, _ = await request(session, port, key, rng.choice(prompts), max_tokens)
            total += tokens if status == 200 else 0
    await asyncio.gather(*(client() for _ in range(clients)))
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def phases(args, keys: dict[str, str], port: int, prompts) -> dict:
    out: dict = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
        await poisson(session, port, keys["quiet"], args.quiet_rate, 3, prompts, 16, 99)     # warm-up
        progress("phase 1: the quiet tenant alone")
        alone = await poisson(session, port, keys["quiet"], args.quiet_rate, args.seconds, prompts, 16, 1)
        progress("phase 2: the quiet tenant with a noisy one at 10x its quota")
        quiet, noisy = await asyncio.gather(
            poisson(session, port, keys["quiet"], args.quiet_rate, args.seconds, prompts, 16, 1),
            poisson(session, port, keys["noisy"], 10 * args.noisy_quota, args.seconds, prompts, 16, 2))
        ttft_alone = [t for s, t, _, _ in alone if s == 200 and t is not None]
        ttft_with = [t for s, t, _, _ in quiet if s == 200 and t is not None]
        out["quiet"] = {"requests_alone": len(alone), "requests_with_noisy": len(quiet),
                        "errors": sum(s != 200 for s, *_ in alone + quiet),
                        "ttft_p50_ms_alone": round(1000 * pct(ttft_alone, 0.5), 1),
                        "ttft_p99_ms_alone": round(1000 * pct(ttft_alone, 0.99), 1),
                        "ttft_p50_ms_with_noisy": round(1000 * pct(ttft_with, 0.5), 1),
                        "ttft_p99_ms_with_noisy": round(1000 * pct(ttft_with, 0.99), 1)}
        out["quiet"]["ttft_p99_ratio"] = round(pct(ttft_with, 0.99) / pct(ttft_alone, 0.99), 3)
        out["noisy"] = {"sent": len(noisy), "served": sum(s == 200 for s, *_ in noisy),
                        "rejected_429": sum(s == 429 for s, *_ in noisy),
                        "429_with_retry_after": sum(s == 429 and ra for s, _, _, ra in noisy),
                        "other_errors": sum(s not in (200, 429) for s, *_ in noisy)}
        progress(f"phase 3: tenants a and b saturating the edge, weights {args.weights}")
        a, b = await asyncio.gather(
            closed(session, port, keys["a"], args.clients, args.seconds, prompts, 64, 3),
            closed(session, port, keys["b"], args.clients, args.seconds, prompts, 64, 4))
        out["shares"] = {"tokens_a": a, "tokens_b": b, "share_a": round(a / max(1, a + b), 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each phase (default 30)")
    ap.add_argument("--quiet-rate", type=float, default=4.0, help="quiet tenant's requests/s (default 4)")
    ap.add_argument("--noisy-quota", type=float, default=1.0, help="noisy tenant's quota in requests/s (default 1)")
    ap.add_argument("--clients", type=int, default=128, help="closed-loop clients per tenant in the shares phase "
                    "(default 128: 256 together, the edge's --max-concurrent; each tenant has more clients than the "
                    "128 batch slots' 3/4, so a client between two requests leaves no slot to the other tenant)")
    args = ap.parse_args()
    keys = {name: "sk-" + secrets.token_hex(16) for name in ("quiet", "noisy", "a", "b")}
    prompts = [[(i * 131 + j * 17) % 2000 + 2 for j in range(64 + (i * 37) % 136)] for i in range(50)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="edgecore-tenants-") as work:
        for label, weights in (("equal", {}), ("weighted", {"a": 3, "b": 1})):
            path = Path(work) / f"tenants-{label}.toml"
            tenants_file(path, keys, args.noisy_quota, weights)
            progress(f"starting an edge with the tenants file ({label} weights)")
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            edge = Edge(path, port)
            try:
                args.weights = weights or "1:1"
                results[label] = asyncio.run(phases(args, keys, edge.port, prompts))
            finally:
                edge.stop()
    eq, wt = results["equal"], results["weighted"]
    ratio = max(eq["quiet"]["ttft_p99_ratio"], wt["quiet"]["ttft_p99_ratio"])
    emit("tenants", "quiet_ttft_p99_ratio", ratio, target=1.2, equal_weights=eq, weights_3_to_1=wt,
         share_a_equal=eq["shares"]["share_a"], share_a_weighted_3_1=wt["shares"]["share_a"],
         seconds_per_phase=args.seconds, quiet_rate=args.quiet_rate, noisy_quota=args.noisy_quota,
         clients_per_tenant=args.clients)


if __name__ == "__main__":
    main()
