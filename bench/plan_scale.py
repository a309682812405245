"""`edgecore plan` at fleet scale: 300 edge regions, 10 core regions, 1,000,000 requests (issue #42: ≤ 5 min).

Builds the topology (each edge region linked to two core regions, 5-60 ms, 1-10 Gbit/s) and a
seeded Poisson trace with sessions, then times `Simulator.run` (wall and CPU seconds: the machine is shared) and
`report` on it (a synthetic accelerator-
class core profile and a CPU edge profile: fixed coefficients, so the run is the same on every machine).
`--requests` scales the trace (10× for the linearity check). Prints one JSON line, writes
bench/results/plan_scale.json (or --name).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from edgecore.deploy.plan import report
from edgecore.deploy.profile import CodecSpeed, CostModel, Profile
from edgecore.deploy.simulator import Simulator
from edgecore.deploy.topology import load_topology
from edgecore.deploy.trace import GenerateSpec, generate

CODECS = {"lossless": CodecSpeed(0.68, 600e6, 2e9), "int8": CodecSpeed(0.44, 1e9, 2e9),
          "q4e": CodecSpeed(0.18, 700e6, 1.4e9), "raw": CodecSpeed(1.0, 2e10, 2e10)}
EDGE = Profile(CostModel(0.004, 2e-5, 1e-7, 2e-4, 3e-9), CODECS, 131072, 131072, 32)     # 8B-class KV
CORE = Profile(CostModel(0.008, 1e-5, 1e-8, 2e-5, 1e-10), CODECS, 131072, 131072, 32)


def topology_text(edges: int, core_regions: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for c in range(core_regions):
        lines += [f"[[regions.dc-{c}.cores]]", f'name = "core-{c}"', "replicas = 4", ""]
    for e in range(edges):
        lines += [f"[[regions.city-{e}.edges]]", f'name = "edge-{e}"', 'codecs = ["lossless", "int8"]', ""]
    for e in range(edges):
        home = e % core_regions
        for c, delay in ((home, rng.uniform(5, 25)), ((home + 1) % core_regions, rng.uniform(25, 60))):
            lines += ["[[links]]", f'from = "city-{e}"', f'to = "dc-{c}"', f"delay_ms = {delay:.1f}",
                      f"bandwidth_mbit = {rng.choice([1000, 2000, 10000])}", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--regions", type=int, default=300, help="edge regions")
    ap.add_argument("--core-regions", type=int, default=10, help="core regions (4 core replicas each)")
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests in the trace")
    ap.add_argument("--rate", type=float, default=400.0, help="arrivals per second (all regions)")
    ap.add_argument("--seed", type=int, default=0, help="topology and trace seed")
    ap.add_argument("--name", default="plan_scale", help="result file name under bench/results/")
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "fleet.toml"
    path.write_text(topology_text(args.regions, args.core_regions, args.seed))
    topo = load_topology(path)
    t = time.perf_counter()
    trace = generate(GenerateSpec(tuple(f"city-{e}" for e in range(args.regions)), args.requests, args.rate,
                                  prompt_mean=512, output_mean=128, max_prompt=8192, session_share=0.3,
                                  seed=args.seed))
    generated = time.perf_counter() - t
    t, cpu = time.perf_counter(), time.process_time()
    result = Simulator(topo, EDGE, CORE).run(trace)
    simulated, simulated_cpu = time.perf_counter() - t, time.process_time() - cpu
    t = time.perf_counter()
    rep = report(result, list(topo.regions[args.core_regions:]))
    reported = time.perf_counter() - t
    out = {"bench": "plan_scale", "metric": "simulate_seconds", "value": round(simulated, 1),
           "simulate_cpu_seconds": round(simulated_cpu, 1),
           "regions": args.regions, "core_regions": args.core_regions, "requests": args.requests,
           "generate_seconds": round(generated, 1), "report_seconds": round(reported, 1),
           "simulated_trace_seconds": rep["simulated_s"], "failed": rep["failed"], "prefill": rep["prefill"],
           "core_utilisation_mean": round(sum(n["utilisation"] for n in rep["nodes"].values() if n["kind"] == "core")
                                          / max(1, sum(n["kind"] == "core" for n in rep["nodes"].values())), 3)}
    print(json.dumps(out))
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
