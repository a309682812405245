"""What encrypting the core-edge link costs in TTFT: bench/ttft.py's row (c) — a random-weight 8k-context Llama
(MHA, so the KV is large), a core in its own process behind the userspace WAN relay (`--mbit` 200, `--delay-ms`
20 one way), layer-wise lossless streaming, the edge waiting for the whole KV (no decode handover) — run twice
side by side: sealed frames (the default) and authenticated-only frames (`EDGECORE_LINK_SEALED=0` on both core
and edge: what every release before sealed frames sent). Requests alternate between the two, fresh prompts each
(no prefix-cache hits), `--repeats` per length. The metric is the sealed TTFT over the authenticated-only TTFT
at each length (target: <= 1.03).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

from common import emit, progress
from ttft import measure, write_model

import torch

from edgecore.deploy.wan_relay import LinkSpec, WanRelay
from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.engine.engine import LLMEngine
from tests.e2e.procs import start_core


async def run(args: argparse.Namespace, model_dir: Path) -> dict:
    cache = CacheConfig(num_blocks=(8192 + 256) // 16 * 2)
    budget = EngineConfig(max_num_batched_tokens=1024, max_num_seqs=4)
    secret_file = model_dir.parent / "secret"
    secret_file.write_bytes(b"link-ttft")
    os.environ["EDGECORE_THREADS"] = str(torch.get_num_threads())
    cores, relays, edges = [], [], {}
    try:
        for mode, sealed in (("sealed", "1"), ("authenticated_only", "0")):
            core, port, _ = start_core(str(secret_file), "--model", str(model_dir), "--dtype", "bf16",
                                       "--max-batched-tokens", str(budget.max_num_batched_tokens), "--kv-blocks",
                                       str(cache.num_blocks), data_dir=str(model_dir.parent / f"core-{mode}"),
                                       env={"EDGECORE_LINK_SEALED": sealed})
            cores.append(core)
            relay = WanRelay(LinkSpec(delay_ms=args.delay_ms, bandwidth_mbit=args.mbit))
            relays.append(relay)
            relay_port = await relay.start(("127.0.0.1", 0), ("127.0.0.1", port))
            os.environ["EDGECORE_LINK_SEALED"] = sealed        # read as the edge's core clients are made
            edges[mode] = EdgeNode(EdgeConfig(str(model_dir), cores=[("127.0.0.1", relay_port)], secret=b"link-ttft",
                                                codecs=["lossless"], local_prefill_below=0, cache=cache, engine=budget,
                                                transfer_timeout=300, handover_tokens=0),
                                     engine=LLMEngine.from_dir(model_dir, "bf16", "cpu", cache, budget))
            os.environ.pop("EDGECORE_LINK_SEALED")
            await edges[mode].start()
        gen, rows = torch.Generator().manual_seed(5), {}
        for n in args.lengths:
            times: dict[str, list[float]] = {mode: [] for mode in edges}
            for r in range(args.repeats + 1):                   # the first round warms both paths, not counted
                for mode, edge in edges.items():
                    prompt = torch.randint(5, 4000, (n,), generator=gen).tolist()
                    t = await measure(edge, prompt, f"{mode}-{n}-{r}")
                    if r:
                        times[mode].append(t)
            med = {mode: statistics.median(v) for mode, v in times.items()}
            rows[str(n)] = {"sealed_ttft_ms": round(med["sealed"] * 1e3, 1),
                            "authenticated_only_ttft_ms": round(med["authenticated_only"] * 1e3, 1),
                            "ratio": round(med["sealed"] / med["authenticated_only"], 3)}
            progress(f"{n} tokens: {rows[str(n)]}")
        return rows
    finally:
        for edge in edges.values():
            await edge.stop()
        for relay in relays:
            await relay.stop()
        for core in cores:
            core.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--mbit", type=float, default=200)
    ap.add_argument("--delay-ms", type=float, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-8k"
        write_model(model_dir)
        rows = asyncio.run(run(args, model_dir))
    worst = max(r["ratio"] for r in rows.values())
    emit("link_ttft", "sealed_over_authenticated_only_ttft_worst", worst, target=1.03, rows=rows,
         link_mbit=args.mbit, delay_ms=args.delay_ms, repeats=args.repeats,
         load_average={"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]})


if __name__ == "__main__":
    main()
