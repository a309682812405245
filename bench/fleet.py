"""A cache-aware fleet on an agent-like workload: `bench/fleet.py [--sessions 16] [--seed 0]` (root: emulated WAN).

`edgecore up`'s launcher runs two cores (dc1, dc2) and two edges (west near dc1, east near dc2; near links
10 ms, far ones 40 ms, 100 Mbit/s) from one topology file; the edges' and cores' KV pools are kept small
(`--edge-blocks`, `--core-blocks`), so contexts are evicted as on a busy node. A seeded multi-turn workload:
sessions arrive one per `--gap` seconds; each turn is the previous prompt + the previous answer + new input
(every session starts with the same 200-token system prompt, as an agent's tools do), until the context
nears the model's limit; each session has a home edge, and `--move` of them move to the other edge part-way
(a user who moved, an edge drained). The same workload runs through three configurations, each on a fresh
fleet:

  a_rtt          today's routing before this round: cores ranked by round trip and load, no disk tier
  b_tier         the same with a disk KV tier at each edge (`--kv-tier-dir`)
  c_tier_prefix  the tier + prefix-aware routing (`--core-routing predicted`, `--local-prefill-below auto`:
                 the edge's own prediction competes) + peer pull: the edges serve each other cached KV
                 (`peer_port` in the topology, over a west-east link as far as the far cores), so a moved
                 session's prefix may come from the edge it left

Per configuration: TTFT p50/p99, prompt tokens computed per request (prompt - cached), KV bytes received by
the edges over the links, the share of reusable prompt tokens (those already sent earlier in the run, by
block) served from a cache, hit tokens by where they were found (edge pool or tier, core), the tier's read
speed, and, after edge-west is restarted (drained, started again on the same tier directory), how much of
its sessions' next prompts came from a cache. Writes bench/results/fleet.json and fleet.png (TTFT by turn;
matplotlib, `pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from common import RESULTS, ROOT, emit, progress, pyplot

from edgecore.deploy.launcher import Launcher
from edgecore.deploy.soak import topology_text
from edgecore.deploy.topology import load_topology
from edgecore.shared.kv.block_manager import prefix_hashes
from edgecore.shared.text.tokenizer import Tokenizer

BLOCK = 16
MAX_TOKENS = 16
CONTEXT_LIMIT = 1024 - MAX_TOKENS - 8
TIER_SIZE = "1G"
CONFIGS = {
    "a_rtt": ["--core-routing", "rtt"],
    "b_tier": ["--core-routing", "rtt", "--kv-tier-dir", "{tier}", "--kv-tier-size", TIER_SIZE],
    "c_tier_prefix": ["--core-routing", "predicted", "--local-prefill-below", "auto", "--kv-tier-dir", "{tier}",
                      "--kv-tier-size", TIER_SIZE],
}
PEER_PULL = {"c_tier_prefix"}         # configurations whose edges serve each other cached KV


@dataclass
class Session:
    sid: int
    start: float                  # seconds after the run's start
    home: int                     # index of its first edge
    move_at: int | None           # the turn from which it uses the other edge
    first: list[int]              # system prompt + its task
    inputs: list[list[int]]       # each later turn's new input
    prompt: list[int] = field(default_factory=list)   # its latest prompt
    last_edge: int = 0


@dataclass
class Turn:
    sid: int
    turn: int
    edge: int
    prompt_tokens: int
    reusable: int                 # prompt tokens (whole blocks) already sent earlier in the run
    cached: int = 0               # usage.prompt_tokens_details.cached_tokens
    ttft: float | None = None
    error: str | None = None


def workload(ids: list[int], sessions: int, gap: float, move: float, seed: int) -> list[Session]:
    rng = random.Random(seed)
    system, out = ids[:200], []
    for sid in range(sessions):
        at = rng.randrange(400, len(ids) - 200)
        task = ids[at:at + rng.randint(60, 120)]
        inputs = []
        for _ in range(12):
            at = rng.randrange(400, len(ids) - 100)
            inputs.append(ids[at:at + rng.randint(30, 80)])
        moves = rng.random() < move
        out.append(Session(sid, sid * gap, sid % 2, rng.randint(2, 4) if moves else None, system + task, inputs))
    return out


class Driver:
    """Runs every session's turns against the edges on one event loop; keeps one `Turn` per request."""

    def __init__(self, urls: list[str], model: str, tok: Tokenizer, think: float):
        self.urls, self.model, self.tok, self.think = urls, model, tok, think
        self.turns: list[Turn] = []
        self.seen: set[int] = set()           # block hashes of every prompt sent so far

    def reusable(self, prompt: list[int]) -> int:
        n = 0
        for h in prefix_hashes(prompt, BLOCK, len(prompt) - 1):
            if h not in self.seen:
                break
            n += BLOCK
        self.seen.update(prefix_hashes(prompt, BLOCK))
        return n

    async def run(self, sessions: list[Session]) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
            await asyncio.gather(*(self.session(http, s) for s in sessions))

    async def session(self, http: aiohttp.ClientSession, s: Session) -> None:
        await asyncio.sleep(s.start)
        prompt = s.first
        for turn in range(len(s.inputs) + 1):
            edge = s.home if s.move_at is None or turn < s.move_at else 1 - s.home
            s.prompt, s.last_edge = prompt, edge
            record, answer = await self.send(http, prompt, edge, s.sid, turn)
            if record.error is not None or turn == len(s.inputs):
                return
            prompt = prompt + answer + s.inputs[turn]
            if len(prompt) > CONTEXT_LIMIT:
                return
            await asyncio.sleep(self.think)

    async def send(self, http: aiohttp.ClientSession, prompt: list[int], edge: int, sid: int, turn: int
                   ) -> tuple[Turn, list[int]]:
        """One streamed completion: its record and the answer's token ids (the text encoded again)."""
        record = Turn(sid, turn, edge, len(prompt), self.reusable(prompt))
        self.turns.append(record)
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent, text = time.monotonic(), []
        try:
            async with http.post(f"{self.urls[edge]}/completions", json=body) as resp:
                if resp.status != 200:
                    record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return record, []
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        if record.ttft is None:
                            record.ttft = time.monotonic() - sent
                        text.append(chunk["choices"][0].get("text", ""))
                    if chunk.get("usage"):
                        record.cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        except (aiohttp.ClientError, TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        return record, self.tok.encode("".join(text), add_special_tokens=False)[:MAX_TOKENS]


def scrape(url: str) -> dict[str, float]:
    """An edge's counters that the bench compares before and after (its /metrics and /stats)."""
    base = url.rsplit("/v1", 1)[0]
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    names = ("edgecore:kv_bytes_received_total", "edgecore:remote_prefills_total", "edgecore:local_prefills_total",
             "edgecore:peer_pull_bytes_total", "edgecore:peer_pull_tokens_total")
    out: dict[str, float] = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for name in names:
            if line.startswith(name):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if line.startswith("edgecore:peer_pulls_total{"):          # by outcome: pulled, partial, failed, slower
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            key = f"peer_pulls_{outcome}"
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    stats = json.loads(urllib.request.urlopen(f"{base}/stats", timeout=10).read())
    for key in ("prefix_cache_hit_tokens", "tier_hit_blocks", "tier_read_bytes", "tier_read_seconds"):
        out[key] = float(stats.get(key, 0) or 0)
    return out


def delta(after: list[dict], before: list[dict]) -> dict[str, float]:
    return {k: sum(a[k] - b.get(k, 0.0) for a, b in zip(after, before, strict=True)) for k in after[0]}


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None


def run_config(name: str, flags: list[str], args: argparse.Namespace, sessions: list[Session], tok: Tokenizer,
               work: Path) -> dict:
    ports = {n: 19300 + i for i, n in enumerate(("core-a", "core-a-http", "core-b", "core-b-http", "edge-west",
                                                 "edge-east", "edge-west-peer", "edge-east-peer"))}
    path = work / name / "topology.toml"
    path.parent.mkdir(parents=True)
    path.write_text(topology_text(args.model, ports, near_ms=10.0, far_ms=40.0, peers=name in PEER_PULL))
    topo = load_topology(path)
    extra = {e: [f.format(tier=work / name / f"tier-{e}") for f in flags] + ["--kv-blocks", str(args.edge_blocks)]
             for e in ("edge-west", "edge-east")}
    extra.update({c: ["--kv-blocks", str(args.core_blocks)] for c in ("core-a", "core-b")})
    with open(work / name / "fleet.log", "w") as log:
        launcher = Launcher(topo, emulate_wan=True, out=log, extra_args=extra)
        try:
            launcher.start()
            urls = [launcher.edge_urls["edge-west"], launcher.edge_urls["edge-east"]]
            driver = Driver(urls, topo.model_name, tok, args.think)
            before = [scrape(u) for u in urls]
            started = time.monotonic()
            asyncio.run(driver.run(sessions))
            took = time.monotonic() - started
            after = [scrape(u) for u in urls]
            restart = after_restart(launcher, driver, sessions, urls)
        finally:
            launcher.stop()
    return summarize(name, driver.turns, delta(after, before), took, restart)


def after_restart(launcher: Launcher, driver: Driver, sessions: list[Session], urls: list[str]) -> dict:
    """edge-west drained and started again (same tier directory): its sessions' latest prompts sent again."""
    proc = next(p for p in launcher.procs if p.label.endswith("edge-west"))
    launcher.restart(proc)
    mine = [s for s in sessions if s.last_edge == 0 and s.prompt][:6]
    before = scrape(urls[0])
    driver.turns, old = [], driver.turns

    async def again() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
            for s in mine:
                await driver.send(http, s.prompt, 0, s.sid, -1)
    asyncio.run(again())
    replay, driver.turns = driver.turns, old
    moved = {k: v - before.get(k, 0.0) for k, v in scrape(urls[0]).items()}
    prompt = sum(t.prompt_tokens for t in replay)
    return {"requests": len(replay), "errors": sum(t.error is not None for t in replay),
            "cached_share": round(sum(t.cached for t in replay) / max(1, prompt), 3),   # anywhere (a core's too)
            "edge_tier_share": round(moved["tier_hit_blocks"] * BLOCK / max(1, prompt), 3),
            "edge_tier_hit_tokens": int(moved["tier_hit_blocks"] * BLOCK),
            "edge_tier_read_MBps": round(moved["tier_read_bytes"] / moved["tier_read_seconds"] / 1e6, 1)
            if moved["tier_read_seconds"] > 0 else None,
            "ttft_p50_s": pct([t.ttft for t in replay if t.ttft is not None], 0.5)}


def summarize(name: str, turns: list[Turn], moved: dict[str, float], took: float, restart: dict) -> dict:
    ok = [t for t in turns if t.error is None]
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    reusable = sum(t.reusable for t in ok)
    cached = sum(t.cached for t in ok)
    reused = sum(min(t.cached, t.reusable) for t in ok)      # per request: one's extra cannot hide another's miss
    by_turn: dict[int, list[float]] = {}
    for t in ok:
        if t.ttft is not None:
            by_turn.setdefault(t.turn, []).append(t.ttft)
    return {
        "config": name, "requests": len(turns), "errors": len(turns) - len(ok),
        "first_errors": [t.error for t in turns if t.error][:3], "seconds": round(took, 1),
        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
        "prefill_tokens_per_request": round(sum(t.prompt_tokens - t.cached for t in ok) / max(1, len(ok)), 1),
        "prompt_tokens_per_request": round(sum(t.prompt_tokens for t in ok) / max(1, len(ok)), 1),
        "kv_bytes_received": int(moved["edgecore:kv_bytes_received_total"]),     # from cores
        "peer_pull_bytes": int(moved["edgecore:peer_pull_bytes_total"]),          # from the other edge
        "peer_pull_tokens": int(moved["edgecore:peer_pull_tokens_total"]),
        "link_kv_bytes": int(moved["edgecore:kv_bytes_received_total"] + moved["edgecore:peer_pull_bytes_total"]),
        "peer_pulls": {k.removeprefix("peer_pulls_"): int(v) for k, v in moved.items() if k.startswith("peer_pulls_")},
        "remote_prefills": int(moved["edgecore:remote_prefills_total"]),
        "local_prefills": int(moved["edgecore:local_prefills_total"]),
        "reusable_tokens": reusable, "cached_tokens": cached,
        "reusable_served_from_cache": round(reused / max(1, reusable), 3),
        # where hits were found: the edges' own lookups (pool, and of those the tier) for every request, local or
        # remote (a remote one's edge hit is its skip_tokens: KV not sent); usage's cached tokens are what was not
        # computed anywhere (for a remote prefill, the core's hit)
        "hit_tokens": {"edge_pool_and_tier": int(moved["prefix_cache_hit_tokens"]),
                       "edge_tier": int(moved["tier_hit_blocks"] * BLOCK), "not_computed_anywhere": cached},
        "tier_read_MBps": round(moved["tier_read_bytes"] / moved["tier_read_seconds"] / 1e6, 1)
        if moved["tier_read_seconds"] > 0 else None,
        "after_restart": restart,
        "ttft_p50_by_turn_s": {str(k): round(statistics.median(v), 4) for k, v in sorted(by_turn.items())},
    }


def plot(results: dict[str, dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        turns = sorted(int(k) for k in r["ttft_p50_by_turn_s"])
        ax.plot(turns, [r["ttft_p50_by_turn_s"][str(t)] * 1e3 for t in turns], marker="o", label=name)
    ax.set_xlabel("turn of the session")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("Agent-like sessions over 2 cores + 2 edges (emulated WAN)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16, help="sessions (default 16)")
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between session arrivals (default 1.5)")
    ap.add_argument("--think", type=float, default=0.3, help="seconds between a session's turns (default 0.3)")
    ap.add_argument("--move", type=float, default=0.3, help="share of sessions that move edge (default 0.3)")
    ap.add_argument("--edge-blocks", type=int, default=384, help="KV blocks per edge (default 384: 6144 tokens)")
    ap.add_argument("--core-blocks", type=int, default=1024, help="KV blocks per core (default 1024: 16384 tokens)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which configurations, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="keep each fleet's log and tier directories here")
    ap.add_argument("--model", default=str(ROOT / "models" / "pydoc-llama"))
    ap.add_argument("--name", default="fleet", help="result name: bench/results/NAME.json (default fleet)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/fleet.py emulates the WAN with network namespaces: run it as root")
    tok = Tokenizer.from_dir(args.model)
    ids = tok.encode(Path(args.model, "heldout.txt").read_text())
    results = {}
    with tempfile.TemporaryDirectory(prefix="edgecore-fleet-") as tmp:
        if args.workdir:                  # the fleets' logs and tiers kept there
            tmp = args.workdir
        for name in args.configs.split(","):
            sessions = workload(ids, args.sessions, args.gap, args.move, args.seed)
            progress(f"{name}: 2 cores + 2 edges, {len(sessions)} sessions")
            results[name] = r = run_config(name, CONFIGS[name], args, sessions, tok, Path(tmp))
            progress(f"{name}: {r['requests']} requests ({r['errors']} errors) in {r['seconds']} s; TTFT p50 "
                     f"{r['ttft_p50_s']} s p99 {r['ttft_p99_s']} s; {r['kv_bytes_received'] / 1e6:.1f} MB KV; "
                     f"{r['reusable_served_from_cache']:.0%} of reusable tokens cached; after restart "
                     f"{r['after_restart']}")
    a, c = results.get("a_rtt"), results.get("c_tier_prefix")
    ratios = {}
    if a and c and c["ttft_p50_s"] and c["link_kv_bytes"]:
        ratios = {"ttft_p50_a_over_c": round(a["ttft_p50_s"] / c["ttft_p50_s"], 2),
                  "kv_bytes_a_over_c": round(a["link_kv_bytes"] / max(1, c["link_kv_bytes"]), 2)}
    plotted = plot(results, RESULTS / f"{args.name}.png")
    emit(args.name, "ttft_p50_a_over_c", ratios.get("ttft_p50_a_over_c"), **ratios, sessions=args.sessions,
         seed=args.seed, edge_blocks=args.edge_blocks, core_blocks=args.core_blocks, plot=plotted,
         gap_s=args.gap, think_s=args.think, move=args.move, configs=results,
         finished=time.strftime("%Y-%m-%d %H:%M:%S"))


if __name__ == "__main__":
    main()
