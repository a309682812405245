"""Soak under faults: `bench/soak.py [--minutes 30] [--fault-every 60] [--load 0.7]` (root: it emulates the WAN).

`edgecore up`'s launcher runs two cores and two edges (each edge near one core and far from the other, 100
Mbit/s links) at `--load` of the capacity measured first; every `--fault-every` seconds one fault in turn: a
core killed (and started again), a core drained and restarted, an edge drained and restarted, a link cut for
5 s, a link slowed 10× for 20 s; at the end a rolling restart of every node under the same load.

Reports requests sent, completed, failed (by cause) and lost (no answer at all: must be 0), TTFT p50/p99 per
minute, and each node's RSS, open file descriptors, threads and KV blocks in use per minute after warm-up,
with whether each is flat within 5% (deploy/soak.py says how). The fleet's own log is kept in
bench/results/NAME.log. Writes bench/results/NAME.json (NAME: `--name`, default `soak`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, emit, progress

from edgecore.deploy.soak import Soak, soak_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the faulted load runs (default 30)")
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults (default 60)")
    ap.add_argument("--load", type=float, default=0.7, help="share of the measured capacity (default 0.7)")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before resources are judged (default 60)")
    ap.add_argument("--calibrate", type=float, default=20.0, help="seconds of the capacity measurement (default 20)")
    ap.add_argument("--model", default=str(ROOT / "models" / "pydoc-llama"))
    ap.add_argument("--name", default="soak", help="result name: bench/results/NAME.json (default soak)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/soak.py emulates the WAN with network namespaces: run it as root")
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgecore-soak-") as work:
        soak = Soak(args.model, Path(work))
        try:
            progress("starting 2 cores and 2 edges over emulated links")
            soak.start(soak_prompts(args.model))
            capacity = soak.calibrate(args.calibrate)
            rate = args.load * capacity
            progress(f"capacity {capacity:.2f} requests/s; soaking {args.minutes:g} min at {rate:.2f} requests/s")
            soak.run(args.minutes * 60, args.fault_every, rate, progress)
            progress("rolling restart of every node under load")
            soak.rolling_restart()
            report = soak.report(args.warmup)
        finally:
            soak.stop()
            shutil.copy(Path(work) / "fleet.log", RESULTS / f"{args.name}.log")
    req = report["requests"]
    progress(f"{req['sent']} sent, {req['completed']} completed, {req['failed']} failed {req['failed_by_cause']}, "
             f"{req['lost']} lost; rolling restart: {report['rolling_restart']}")
    flat = {label: {k[:-5]: v for k, v in node.items() if k.endswith("_flat")}
            for label, node in report["nodes"].items()}
    emit(args.name, "lost_requests", req["lost"], duration_min=args.minutes, fault_every_s=args.fault_every,
         load=args.load, capacity_rps=round(capacity, 3), rate_rps=round(rate, 3), flat=flat,
         finished=time.strftime("%Y-%m-%d %H:%M:%S"), **report)


if __name__ == "__main__":
    main()
