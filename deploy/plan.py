"""`edgecore plan`: the simulator's result as a report, and `--search` for the cheapest fleet meeting the SLOs.

Life cycle: `report(result)` reduces a simulator `Result` (deploy/simulator.py) to one JSON-able dict, the
shape scripts rely on (and `edgecore replay` prints, measured):
    {"regions": {REGION: {"requests", "failed", "ttft_ms": {"p50", "p90", "p99"}, "tpot_ms": {…}, "e2e_ms": {…},
                          "prefill": {"local", "remote", "cache"}}},
     "nodes": {NODE: {"kind", "region", "utilisation", "queue_mean", "queue_peak", "requests"}},
     "links": {"CORE_REGION->EDGE_REGION": {"bytes", "peak_mbit", "transfers", "codecs"}},
     "prefill": {"local", "remote", "cache"}, "requests", "failed", "simulated_s"}
(percentiles in milliseconds, null where a region had no such request; shares of requests). `render_text`
prints it for people. `search(...)` starts every core and edge of the topology at one replica, simulates,
and while a region misses its SLO adds the replica (an edge of that region, or a core it reaches) that most
lowers the worst SLO ratio per unit of cost; when all regions meet their SLOs it removes replicas that are
not needed, dearest first. Codecs are chosen per request by the edge's adaptive policy with the TTFT SLO as
its target; the codec used most on each link is reported. `plot(...)` draws PNGs with matplotlib (the
`bench` extra), imported only then.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from edgecore.deploy.profile import Profile
from edgecore.deploy.simulator import Options, Result, Simulator
from edgecore.deploy.topology import Slo, Topology
from edgecore.deploy.trace import Request, Trace
from edgecore.shared.errors import ConfigError

PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {name: None for name, _ in PERCENTILES}
    import numpy as np
    arr = np.asarray(values, dtype=float) * 1000
    return {name: round(float(np.percentile(arr, q)), 3) for name, q in PERCENTILES}


class Row(Protocol):
    """What a region's statistics read of a request: a simulated `Job` or a replayed `Measured`."""
    @property
    def req(self) -> Request: ...
    @property
    def where(self) -> str: ...
    @property
    def arrive(self) -> float: ...
    @property
    def ttft(self) -> float: ...
    @property
    def done(self) -> float: ...


def region_stats(rows: Iterable[Row], names: list[str]) -> tuple[dict[str, Any], dict[str, int], int]:
    """Per region: requests, failed, TTFT/TPOT/E2E percentiles, prefill shares; the totals by placement; the
    failed count."""
    per: dict[str, dict[str, list[float]]] = {r: {"ttft": [], "tpot": [], "e2e": []} for r in names}
    where: dict[str, dict[str, int]] = {r: {"local": 0, "remote": 0, "cache": 0, "failed": 0} for r in names}
    for job in rows:
        region = job.req.region
        if region not in per:
            per[region] = {"ttft": [], "tpot": [], "e2e": []}
            where[region] = {"local": 0, "remote": 0, "cache": 0, "failed": 0}
        kind = job.where if job.where in ("local", "remote", "cache") else "failed"
        where[region][kind] += 1
        if kind == "failed":
            continue
        lists = per[region]
        lists["ttft"].append(job.ttft - job.arrive)
        lists["e2e"].append(job.done - job.arrive)
        if job.req.output_tokens > 1:
            lists["tpot"].append((job.done - job.ttft) / (job.req.output_tokens - 1))
    out_regions: dict[str, Any] = {}
    total = {"local": 0, "remote": 0, "cache": 0}
    for region in per:
        counts = where[region]
        served = counts["local"] + counts["remote"] + counts["cache"]
        for k in total:
            total[k] += counts[k]
        out_regions[region] = {
            "requests": served + counts["failed"], "failed": counts["failed"],
            "ttft_ms": percentiles(per[region]["ttft"]), "tpot_ms": percentiles(per[region]["tpot"]),
            "e2e_ms": percentiles(per[region]["e2e"]),
            "prefill": {k: round(counts[k] / served, 4) if served else 0.0 for k in ("local", "remote", "cache")}}
    return out_regions, total, sum(w["failed"] for w in where.values())


def report(result: Result, regions: list[str] | None = None) -> dict[str, Any]:
    names = regions if regions is not None else sorted({j.req.region for j in result.jobs})
    out_regions, total, failed = region_stats(result.jobs, names)
    duration = max(result.duration, 1e-9)
    nodes = {n.name: {"kind": n.kind, "region": n.region, "utilisation": round(min(1.0, n.busy / duration), 4),
                      "queue_mean": round(n.queue_area / duration, 3), "queue_peak": n.queue_peak,
                      "requests": n.served} for n in result.nodes}
    links = {f"{a}->{b}": {"bytes": int(link.bytes), "transfers": link.transfers,
                           "peak_mbit": round(max(link.windows.values(), default=0.0) * 8 / 1e6, 3),
                           "codecs": dict(sorted(link.codecs.items()))}
             for (a, b), link in sorted(result.links.items()) if link.transfers}
    served = sum(total.values())
    return {"regions": out_regions, "nodes": nodes, "links": links,
            "prefill": {k: round(v / served, 4) if served else 0.0 for k, v in total.items()},
            "requests": served + failed, "failed": failed, "simulated_s": round(result.duration, 3)}


def measured_report(rows: list[Any], regions: list[str], seconds: float) -> dict[str, Any]:
    """`edgecore replay`'s report: the same shape, measured (nodes and links empty; served requests count as
    remote: a client does not see where the prompt was prefilled)."""
    out_regions, total, failed = region_stats(rows, regions)
    served = sum(total.values())
    return {"regions": out_regions, "nodes": {}, "links": {},
            "prefill": {k: round(v / served, 4) if served else 0.0 for k, v in total.items()},
            "requests": served + failed, "failed": failed, "measured_s": round(seconds, 3)}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def render_text(rep: dict[str, Any]) -> str:
    seconds = f"{rep['simulated_s']} s simulated" if "simulated_s" in rep else f"{rep['measured_s']} s measured"
    lines = [f"{rep['requests']} requests ({rep['failed']} failed) over {seconds}; "
             f"prefilled locally {rep['prefill']['local']:.1%}, at a core {rep['prefill']['remote']:.1%}, "
             f"from a cached prefix {rep['prefill']['cache']:.1%}", "",
             f"{'region':<20}{'requests':>9}  {'TTFT ms p50/p90/p99':>24}  {'TPOT ms p50/p90/p99':>22}  "
             f"{'E2E ms p50/p90/p99':>26}"]
    for region, r in rep["regions"].items():
        cols = ["/".join(_ms(r[k][p]) for p, _ in PERCENTILES) for k in ("ttft_ms", "tpot_ms", "e2e_ms")]
        lines.append(f"{region:<20}{r['requests']:>9}  {cols[0]:>24}  {cols[1]:>22}  {cols[2]:>26}")
    if rep["nodes"]:
        lines += ["", f"{'node':<24}{'kind':<6}{'util':>7}{'queue mean':>12}{'peak':>7}{'requests':>10}"]
    for name, n in rep["nodes"].items():
        lines.append(f"{name:<24}{n['kind']:<6}{n['utilisation']:>7.1%}{n['queue_mean']:>12}{n['queue_peak']:>7}"
                     f"{n['requests']:>10}")
    if rep["links"]:
        lines += ["", f"{'link':<36}{'MB':>10}{'peak Mbit/s':>13}  codecs"]
        for name, link in rep["links"].items():
            lines.append(f"{name:<36}{link['bytes'] / 1e6:>10.2f}{link['peak_mbit']:>13}  "
                         + ", ".join(f"{c} {n}" for c, n in link["codecs"].items()))
    return "\n".join(lines)


def simulate(topology: Topology, trace: Trace, profile: Profile, core_profile: Profile | None,
             options: Options) -> dict[str, Any]:
    result = Simulator(topology, profile, core_profile, options).run(trace)
    return report(result, edge_regions(topology))


def edge_regions(topology: Topology) -> list[str]:
    return [r for r in topology.regions if any(e.region == r for e in topology.edges)]


# ---- search ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SloTarget:
    ttft_ms: float | None
    tpot_ms: float | None
    percentile: str


def slos(topology: Topology, ttft_ms: float | None = None, tpot_ms: float | None = None,
         percentile: str | None = None) -> dict[str, SloTarget]:
    """Each region's SLO: the topology's [plan.region_slo] or [plan.slo], flags overriding."""
    out = {}
    for region in edge_regions(topology):
        base: Slo = topology.plan.region_slo.get(region, topology.plan.slo)
        out[region] = SloTarget(ttft_ms if ttft_ms is not None else base.ttft_ms,
                                tpot_ms if tpot_ms is not None else base.tpot_ms, percentile or base.percentile)
    if all(s.ttft_ms is None and s.tpot_ms is None for s in out.values()):
        raise ConfigError("--search needs an SLO: [plan.slo] ttft_ms / tpot_ms in the topology, or "
                          "--slo-ttft-ms / --slo-tpot-ms")
    return out


def worst_ratio(rep: dict[str, Any], targets: dict[str, SloTarget]) -> tuple[float, str]:
    """The largest measured/SLO ratio over the regions (≤ 1: every SLO met) and its region; a region that lost
    requests fails."""
    worst, where = 0.0, ""
    for region, t in targets.items():
        r = rep["regions"].get(region)
        if r is None or not r["requests"]:
            continue
        ratio = 0.0 if not r["failed"] else float("inf")
        for key, target in (("ttft_ms", t.ttft_ms), ("tpot_ms", t.tpot_ms)):
            value = r[key][t.percentile]
            if target is not None and value is not None:
                ratio = max(ratio, value / target)
        if ratio > worst:
            worst, where = ratio, region
    return worst, where


def fleet_cost(topology: Topology, replicas: dict[str, int]) -> float:
    return (sum(replicas[c.name] for c in topology.cores) * topology.plan.core_cost
            + sum(replicas[e.name] for e in topology.edges) * topology.plan.edge_cost)


def search(topology: Topology, trace: Trace, profile: Profile, core_profile: Profile | None, options: Options,
           targets: dict[str, SloTarget], max_rounds: int = 200, log: Any = None) -> dict[str, Any]:
    say = log or (lambda _m: None)
    ttft = min((t.ttft_ms for t in targets.values() if t.ttft_ms is not None), default=None)
    options = replace(options, adaptive=True, ttft_target_ms=ttft)
    limit = topology.plan.max_replicas
    node_cost = {c.name: topology.plan.core_cost for c in topology.cores}
    node_cost |= {e.name: topology.plan.edge_cost for e in topology.edges}
    reach = {r: [c.name for c in topology.cores_for(r)] for r in targets}
    cache: dict[tuple[tuple[str, int], ...], tuple[float, str, dict[str, Any]]] = {}
    frontier: list[dict[str, Any]] = []

    def evaluate(replicas: dict[str, int]) -> tuple[float, str, dict[str, Any]]:
        key = tuple(sorted(replicas.items()))
        if key not in cache:
            rep = simulate(topology, trace, profile, core_profile, replace(options, replicas=dict(replicas)))
            ratio, region = worst_ratio(rep, targets)
            cache[key] = (ratio, region, rep)
            frontier.append({"cost": fleet_cost(topology, replicas), "worst_slo_ratio": round(ratio, 4),
                             "replicas": dict(replicas)})
            say(f"cost {fleet_cost(topology, replicas):g}: worst SLO ratio {ratio:.3f} ({region or 'none'})")
        return cache[key]

    fleet = dict.fromkeys(node_cost, 1)
    ratio, region, rep = evaluate(fleet)
    rounds, stuck = 0, ""
    while ratio > 1 and rounds < max_rounds:
        rounds += 1
        options_up = [n for n in [e.name for e in topology.edges if e.region == region] + reach.get(region, [])
                      if fleet[n] < limit]
        if not options_up:
            break
        best: tuple[float, str] | None = None
        for name in options_up:
            trial = {**fleet, name: fleet[name] + 1}
            r, _, _ = evaluate(trial)
            gain = (ratio - r) / max(node_cost[name], 1e-9)
            if best is None or gain > best[0]:
                best = (gain, name)
        assert best is not None
        if best[0] <= 1e-9:
            stuck = region               # no replica helps: its link or codecs bound it, not the fleet's size
            break
        fleet[best[1]] += 1
        ratio, region, rep = evaluate(fleet)
    feasible = ratio <= 1
    if feasible:                         # trim: dearest first, while every SLO still holds
        for name in sorted(fleet, key=lambda n: -node_cost[n]):
            while fleet[name] > 1:
                trial = {**fleet, name: fleet[name] - 1}
                r, _, trial_rep = evaluate(trial)
                if r > 1:
                    break
                fleet, ratio, rep = trial, r, trial_rep
    codecs = {name: max(link["codecs"], key=link["codecs"].get) for name, link in rep["links"].items()
              if link["codecs"]}
    return {"feasible": feasible, "cost": fleet_cost(topology, fleet), "replicas": fleet, "codecs": codecs,
            "worst_slo_ratio": round(ratio, 4), "evaluations": len(cache),
            "limited_by": stuck and f"region {stuck}: adding a replica does not lower its SLO ratio (its links or "
                                    f"codecs bound it)",
            "slo": {r: {"ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms, "percentile": t.percentile}
                    for r, t in targets.items()},
            "frontier": sorted(frontier, key=lambda f: f["cost"]), "plan": rep}


# ---- plots ----------------------------------------------------------------------------------------------

def plot(result: Result, out_dir: str | Path, frontier: list[dict[str, Any]] | None = None) -> list[Path]:
    """TTFT CDF per region, node utilisation (bars) and, after a search, the cost / SLO-ratio frontier."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install 'edgecore[bench]')") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_region: dict[str, list[float]] = {}
    for job in result.jobs:
        if job.where in ("local", "remote", "cache"):
            by_region.setdefault(job.req.region, []).append((job.ttft - job.arrive) * 1000)
    for region, values in sorted(by_region.items())[:20]:
        values.sort()
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=region)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of requests")
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    files.append(out / "ttft_cdf.png")
    fig.savefig(files[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    duration = max(result.duration, 1e-9)
    names = [n.name for n in result.nodes][:60]
    ax.bar(names, [min(1.0, n.busy / duration) for n in result.nodes][:60])
    ax.set_ylabel("utilisation")
    ax.tick_params(axis="x", rotation=90, labelsize=6)
    files.append(out / "utilisation.png")
    fig.savefig(files[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    if frontier:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter([f["cost"] for f in frontier], [min(f["worst_slo_ratio"], 10) for f in frontier])
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set_xlabel("fleet cost")
        ax.set_ylabel("worst measured / SLO (capped at 10)")
        files.append(out / "search_frontier.png")
        fig.savefig(files[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return files
