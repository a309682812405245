"""KV pulled from a peer edge against recomputing it: time to first token of a prompt whose long prefix another
edge holds. `bench/peer_pull.py [--prefix 2048] [--prompts 4]`.

One process, three in-process edges of one random-weight Llama of realistic proportions (bench/kv_tier.py's
`synthetic_model`; the bundled model with `--model bundled`), one torch thread: edge A serves its cached KV to
peers (`--peer-listen`), edge B pulls from it (`--peer`), edge C has no peer. For each prompt, A prefills
prefix + suffix (and so caches the prefix); once B has A's digest, B and C each serve prefix + a new suffix, in
alternating order: B pulls the prefix (loopback link, lossless) and prefills the suffix, C computes everything.
Reported: TTFT of B and C (median and each), their ratio, tokens pulled and bytes, the pull outcome counts, and
that B's tokens equal C's (the pulled KV is the same KV).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import ROOT, emit, progress
from kv_tier import SYNTHETIC, synthetic_model

from edgecore.edge.core_cache import PromptHashes
from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.config import CacheConfig, EngineConfig

SECRET = b"bench-peer-pull-secret-0123456789"
SUFFIX = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def engine(kind: str, cache: CacheConfig) -> tuple[LLMEngine, str]:
    """An engine and the model directory edges fingerprint it by (the synthetic model's: its config and a stand-in
    weights file, the same for every edge)."""
    if kind == "bundled":
        model_dir = str(ROOT / "models" / "pydoc-llama")
        return LLMEngine.from_dir(model_dir, "fp32", "cpu", cache, EngineConfig()), model_dir
    model, config = synthetic_model()
    model_dir = Path(tempfile.gettempdir()) / "edgecore-bench-peer-pull-model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(SYNTHETIC))
    from safetensors.torch import save_file      # a header for the fingerprint (the weights are the engine's)
    save_file({"synthetic": torch.zeros(1)}, str(model_dir / "model.safetensors"))
    return LLMEngine(model, config, None, cache, EngineConfig()), str(model_dir)


async def first_token(edge: EdgeNode, rid: str, ids: list[int]) -> tuple[float, list[int], int]:
    start, ttft, tokens, cached = time.perf_counter(), None, [], 0
    async for out in edge.generate(rid, ids, GREEDY):
        if ttft is None and out.new_token_ids:
            ttft = time.perf_counter() - start
        tokens += out.new_token_ids
        cached = max(cached, out.num_cached_tokens or 0)
    assert ttft is not None
    return ttft, tokens, cached


async def announced(b: EdgeNode, ids: list[int], tokens: int) -> None:
    client = b.peer_pull.router.clients[0]
    for _ in range(400):
        if client.healthy and client.cache.cached_tokens(PromptHashes(ids, None)) >= tokens:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("edge B never learned that A holds the prefix")


async def run(args: argparse.Namespace) -> dict:
    blocks = (args.prefix + SUFFIX) * 2 // 16 + 64
    cache = CacheConfig(block_size=16, num_blocks=blocks * args.prompts)
    a_engine, model_dir = engine(args.model, cache)
    a = EdgeNode(EdgeConfig(model_dir=model_dir, secret=SECRET, peer_listen=("127.0.0.1", 0), name="a"), a_engine)
    await a.start()
    assert a.peer_server is not None
    b = EdgeNode(EdgeConfig(model_dir=model_dir, secret=SECRET, peers=[("127.0.0.1", a.peer_server.port)],
                            name="b"), engine(args.model, cache)[0])
    c = EdgeNode(EdgeConfig(model_dir=model_dir, secret=SECRET, name="c"), engine(args.model, cache)[0])
    await b.start()
    await c.start()
    rng, vocab = random.Random(0), a.handle.config.vocab_size
    rows = []
    try:
        await first_token(c, "warm-c", [rng.randrange(vocab) for _ in range(64)])     # first-call costs, not timed
        await first_token(b, "warm-b", [rng.randrange(vocab) for _ in range(8)])
        for i in range(args.prompts):
            prefix = [rng.randrange(vocab) for _ in range(args.prefix)]
            await first_token(a, f"a{i}", prefix + [rng.randrange(vocab) for _ in range(SUFFIX)])
            ids = prefix + [rng.randrange(vocab) for _ in range(SUFFIX)]
            await announced(b, ids, args.prefix // 16 * 16)
            order = [("b", b), ("c", c)] if i % 2 == 0 else [("c", c), ("b", b)]
            got = {name: await first_token(edge, f"{name}{i}", ids) for name, edge in order}
            rows.append({"pulled_s": round(got["b"][0], 4), "computed_s": round(got["c"][0], 4),
                         "cached_b": got["b"][2], "same_tokens": got["b"][1] == got["c"][1]})
            progress(f"prompt {i}: pulled {got['b'][0] * 1e3:.0f} ms ({got['b'][2]} cached), computed "
                     f"{got['c'][0] * 1e3:.0f} ms")
        m = b.metrics
        pulls = {o: int(m.peer_pulls.labels(o)._value.get()) for o in ("pulled", "partial", "failed", "slower")}
        return {"rows": rows, "pulls": pulls, "pulled_tokens": int(m.peer_pull_tokens._value.get()),
                "pulled_bytes": int(m.peer_pull_bytes._value.get()),
                "kv_bytes_per_token": b.handle.kv_bytes_per_token}
    finally:
        for edge in (c, b, a):
            await edge.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=2048, help="tokens a peer holds (default 2048)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    ap.add_argument("--model", choices=("synthetic", "bundled"), default="synthetic")
    args = ap.parse_args()
    torch.set_num_threads(1)
    r = asyncio.run(run(args))
    pulled = statistics.median(row["pulled_s"] for row in r["rows"])
    computed = statistics.median(row["computed_s"] for row in r["rows"])
    emit("peer_pull", "computed_over_pulled_ttft", round(computed / pulled, 2), model=args.model, prefix=args.prefix,
         prompts=args.prompts, pulled_ttft_median_s=round(pulled, 4), computed_ttft_median_s=round(computed, 4),
         same_tokens=all(row["same_tokens"] for row in r["rows"]), link="loopback", codec="lossless",
         torch_threads=1, **r)


if __name__ == "__main__":
    main()
