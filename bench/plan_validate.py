"""`edgecore plan` checked against real runs: predicted vs measured TTFT and TPOT, per scenario and region.

For each scenario: write its topology, start it with `edgecore up --shared-secret` (this machine's processes;
`--emulate-wan` as root for the scenario with WAN links), generate a seeded trace, predict it with
`edgecore plan`'s simulator and the given profile, replay it with `edgecore replay`'s client (killing a core
mid-run in the failure scenario), stop the topology, and compare medians (target: within 10%) and p99
(within 20%). Scenarios: `one` (a core and an edge in one region), `failure` (two cores and an edge; one core
is killed halfway through the trace), `wan` (two edge regions 20 and 80 ms from the core, 100 and 20 Mbit/s:
needs --emulate-wan, root, and a machine where nothing else uses `ec-*` network namespaces, so it runs only
when asked for by name). Prints one JSON line, writes bench/results/plan_validate.json (or --name).

    .venv/bin/python bench/plan_validate.py --profile profile.json [--scenarios one failure] [--requests 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from edgecore.deploy.fleet_run import start_fleet, stop_fleet
from edgecore.deploy.plan import edge_regions, measured_report, report
from edgecore.deploy.profile import load_profile, measure, save
from edgecore.deploy.replay import replay
from edgecore.deploy.simulator import Options, Simulator
from edgecore.deploy.topology import load_topology
from edgecore.deploy.trace import GenerateSpec, generate
from edgecore.models import bundled_model_dir

ROOT = Path(__file__).resolve().parents[1]
MODEL = bundled_model_dir()
SCENARIOS = {
    "one": """
[model]
path = "{model}"
[[regions.here.cores]]
name = "core"
port = {p0}
http_port = {p1}
[[regions.here.edges]]
name = "edge"
port = {p2}
""",
    "failure": """
[model]
path = "{model}"
[[regions.here.cores]]
name = "core-a"
port = {p0}
http_port = {p1}
[[regions.here.cores]]
name = "core-b"
port = {p3}
http_port = {p4}
[[regions.here.edges]]
name = "edge"
port = {p2}
""",
    "wan": """
[model]
path = "{model}"
[[regions.dc.cores]]
name = "core"
port = {p0}
http_port = {p1}
[[regions.near.edges]]
name = "edge-near"
port = {p2}
[[regions.far.edges]]
name = "edge-far"
port = {p3}
[[links]]
from = "near"
to = "dc"
delay_ms = 20
bandwidth_mbit = 100
[[links]]
from = "far"
to = "dc"
delay_ms = 80
bandwidth_mbit = 20
""",
}


def kill_core(launcher: subprocess.Popen, name: str) -> None:
    """SIGKILL the core process named `name` (a child of the launcher): a crash, not a drain. `edgecore up`
    stops the whole topology when a node exits, so the launcher is paused first (SIGSTOP) and resumed by
    `stop_fleet` once the replay is over: the other nodes run on as they would after a core's crash in a fleet."""
    children = _descendants(launcher.pid)
    launcher.send_signal(signal.SIGSTOP)
    for pid, cmd in children:
        if "core" in cmd and "--name" in cmd and cmd[cmd.index("--name") + 1] == name:
            os.kill(pid, signal.SIGKILL)
            return
    raise SystemExit(f"no core process named {name}")


def _descendants(root: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every process below `root`, from /proc."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        for child in [c for c, p in parent.items() if p == pid]:
            try:
                argv = (Path("/proc") / str(child) / "cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            found.append((child, argv))
            frontier.append(child)
    return found


def err(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return round(predicted / measured - 1, 3)


def run(name: str, args: argparse.Namespace, profile_path: Path, work: Path) -> list[dict]:
    base = args.port
    text = SCENARIOS[name].format(model=MODEL, p0=base, p1=base + 1, p2=base + 2, p3=base + 3, p4=base + 4)
    topo_path = work / f"{name}.toml"
    topo_path.write_text(text)
    topo = load_topology(topo_path)
    regions = edge_regions(topo)
    trace = generate(GenerateSpec(tuple(regions), args.requests, args.rate, prompt_mean=args.prompt_mean,
                                  output_mean=args.output_mean, max_prompt=600, max_output=200,
                                  session_share=0.2, seed=args.seed))
    cut = trace.duration / 2
    profile = load_profile(profile_path)
    failures = (("core-b", cut),) if name == "failure" else ()
    # the fleet runs on this machine: its nodes share its cores (the profile was measured on them, alone)
    predicted = report(Simulator(topo, profile, options=Options(failures=failures, shared_cpus=os.cpu_count()))
                       .run(trace), regions)
    proc, urls = start_fleet(topo_path, name == "wan", work / f"{name}.log")
    try:
        edge_urls = {r: next(urls[e.name] for e in topo.edges if e.region == r) for r in regions}
        vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
        if failures:
            threading.Timer(cut, kill_core, (proc, "core-b")).start()
        t = time.perf_counter()
        records = asyncio.run(replay(trace, edge_urls, topo.model_name, vocab, timeout=600))
        measured = measured_report(records, regions, time.perf_counter() - t)
    finally:
        stop_fleet(proc)
    rows = []
    for region in regions:
        p, m = predicted["regions"][region], measured["regions"][region]
        row = {"scenario": name, "region": region, "requests": m["requests"], "failed": m["failed"]}
        for metric in ("ttft_ms", "tpot_ms"):
            for q in ("p50", "p99"):
                row[f"{metric}_{q}_predicted"] = p[metric][q]
                row[f"{metric}_{q}_measured"] = m[metric][q]
                row[f"{metric}_{q}_error"] = err(p[metric][q], m[metric][q])
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="profile JSON (default: measure one now, --quick --serving)")
    ap.add_argument("--scenarios", nargs="+", default=["one", "failure"], choices=list(SCENARIOS),
                    help="scenarios to run (wan needs --emulate-wan: root, network namespaces)")
    ap.add_argument("--requests", type=int, default=60, help="requests per scenario")
    ap.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    ap.add_argument("--prompt-mean", type=int, default=200, help="mean prompt tokens")
    ap.add_argument("--output-mean", type=int, default=32, help="mean output tokens")
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    ap.add_argument("--port", type=int, default=7600, help="first of the five ports the nodes use")
    ap.add_argument("--name", default="plan_validate", help="result file name under bench/results/")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plan-validate-"))
    profile_path = Path(args.profile) if args.profile else work / "profile.json"
    if not args.profile:
        from edgecore.deploy.serving_probe import measure_serving
        save(measure_serving(measure(str(MODEL), quick=True), str(MODEL), args.port + 10), profile_path)
    rows = [row for name in args.scenarios for row in run(name, args, profile_path, work)]
    within = [r for r in rows if all(r[f"{m}_p50_error"] is not None and abs(r[f"{m}_p50_error"]) <= 0.10
                                     for m in ("ttft_ms", "tpot_ms"))]
    out = {"bench": "plan_validate", "metric": "regions_with_medians_within_10pct", "value": len(within),
           "of": len(rows), "rows": rows, "profile": str(profile_path), "machine_load": os.getloadavg()}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
