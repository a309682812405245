"""Soak under faults (`bench/soak.py`): a fleet of two cores and two edges started by `edgecore up`'s launcher
over emulated WAN links, kept at a steady share of its capacity while one fault per period is injected, with
every node's resources sampled.

Life cycle: `Soak(model, workdir)`; `start()` writes the topology (a core in each of regions dc1 and dc2, an
edge in each of west and east, every edge linked to both core regions: one near, one far) and starts it with
`Launcher(emulate_wan=True)` (root) → `calibrate()`: the capacity in requests/s from a closed loop →
`run(seconds, fault_every, rate)`: a Poisson load (`soak_load.Load`), a fault thread (the first fault after
one period, then one per period, the `FAULTS` in turn, each at the next node or link of its kind) and a
sampler (every `SAMPLE_S` s, each node's `soak_probe.sample`) → `rolling_restart()`: after a settling
time without faults, every node drained and restarted one at a time under the same load → `stop()` → `report()`, one JSON-ready dict.

Faults: `kill_core` (SIGKILL, then started again as a supervisor would), `drain_core` and `drain_edge`
(SIGTERM: a drain, then started again), `cut_link` (both ends down for `CUT_S` s) and `slow_link` (its
bandwidth cut 10× for `SLOW_S` s). A node's resources are judged flat over the minutes after warm-up that
are not its first after a (re)start: resident memory, file descriptors and threads within 5% (largest over
smallest per-minute median), KV blocks in use within 5% of its pool.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from edgecore.deploy.launcher import Launcher, Proc
from edgecore.deploy.soak_load import Load, Result
from edgecore.deploy.soak_probe import NodeSample, sample
from edgecore.deploy.topology import load_topology
from edgecore.shared.text.tokenizer import Tokenizer

FAULTS = ("kill_core", "drain_core", "drain_edge", "cut_link", "slow_link")
CUT_S = 5.0             # a cut link is down this long
SLOW_S = 20.0           # a slowed link stays slow this long
SAMPLE_S = 5.0          # seconds between resource samples
LINK_MBIT = 100.0       # each link's bandwidth (a slowed one: a tenth of it)
FLAT = 0.05             # "flat": within 5%
CALIBRATE_CLIENTS = 8


def topology_text(model: str, ports: dict[str, int], near_ms: float = 10.0, far_ms: float = 30.0,
                  peers: bool = False) -> str:
    """The soak's topology: cores core-a (dc1) and core-b (dc2), edges edge-west and edge-east; west is near
    dc1 and far from dc2, east the other way round. `peers`: the edges serve each other cached KV (ports
    `edge-west-peer`, `edge-east-peer`) over a west-east link as far as the far cores."""
    serve = {e: f"peer_port = {ports[e + '-peer']}\n" if peers else "" for e in ("edge-west", "edge-east")}
    links = "".join(f"""
[[links]]
from = "{edge}"
to = "{dc}"
delay_ms = {near_ms if near else far_ms}
bandwidth_mbit = {LINK_MBIT}
""" for edge, dc, near in (("west", "dc1", True), ("west", "dc2", False), ("east", "dc1", False),
                           ("east", "dc2", True)))
    if peers:
        links += f"""
[[links]]
from = "west"
to = "east"
delay_ms = {far_ms}
bandwidth_mbit = {LINK_MBIT}
"""
    return f"""[model]
path = "{model}"
[[regions.dc1.cores]]
name = "core-a"
port = {ports['core-a']}
http_port = {ports['core-a-http']}
drain_timeout = 20.0
[[regions.dc2.cores]]
name = "core-b"
port = {ports['core-b']}
http_port = {ports['core-b-http']}
drain_timeout = 20.0
[[regions.west.edges]]
name = "edge-west"
port = {ports['edge-west']}
drain_timeout = 20.0
{serve['edge-west']}[[regions.east.edges]]
name = "edge-east"
port = {ports['edge-east']}
drain_timeout = 20.0
{serve['edge-east']}{links}"""


def soak_prompts(model: str, count: int = 40) -> list[list[int]]:
    """`count` prompts of 100 to 400 tokens cut from the model's held-out text (overlapping: some share a prefix)."""
    tok = Tokenizer.from_dir(model)
    held = Path(model, "heldout.txt")
    ids = tok.encode(held.read_text() if held.is_file() else "The quick brown fox jumps over the lazy dog. " * 400)
    while len(ids) < 2400:
        ids = ids + ids
    return [ids[(i * 173) % 2000: (i * 173) % 2000 + 100 + (i * 37) % 300] for i in range(count)]


@dataclass
class FaultRecord:
    at: float                 # seconds from the run's start
    kind: str
    target: str
    took: float = 0.0         # seconds until the fault was over (the node ready again, the link restored)
    error: str | None = None


@dataclass
class NodeSeries:
    samples: list[tuple[float, NodeSample]] = field(default_factory=list)   # (seconds from start, sample)
    restarts: list[float] = field(default_factory=list)                     # seconds from start


class Soak:
    def __init__(self, model: str, workdir: Path, out: TextIO | None = None, seed: int = 0):
        self.model, self.workdir, self.seed = model, workdir, seed
        self.log = out if out is not None else open(workdir / "fleet.log", "w")   # noqa: SIM115 - closed in stop()
        self.launcher: Launcher | None = None
        self.load: Load | None = None
        self.faults: list[FaultRecord] = []
        self.nodes: dict[str, NodeSeries] = {}
        self.t0 = 0.0
        self.rolling: dict[str, float] = {}
        self._stop = threading.Event()

    # ---- the fleet --------------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], max_tokens: int = 16) -> None:
        ports = {name: 19100 + i for i, name in enumerate(("core-a", "core-a-http", "core-b", "core-b-http",
                                                           "edge-west", "edge-east"))}
        path = self.workdir / "topology.toml"
        path.write_text(topology_text(self.model, ports))
        topo = load_topology(path)
        self.launcher = Launcher(topo, emulate_wan=True, out=self.log)
        self.launcher.start()
        self.load = Load(list(self.launcher.edge_urls.values()), topo.model_name, prompts, max_tokens, self.seed)
        self.nodes = {p.label: NodeSeries() for p in self.launcher.procs}

    def stop(self) -> None:
        self._stop.set()
        if self.load is not None:
            self.load.stop()
        if self.launcher is not None:
            self.launcher.stop()
        self.log.close()

    def calibrate(self, seconds: float = 20.0) -> float:
        assert self.load is not None
        self.load.closed(CALIBRATE_CLIENTS, 3.0)            # warm-up: first requests, compiled paths, caches
        return self.load.closed(CALIBRATE_CLIENTS, seconds)

    # ---- the run --------------------------------------------------------------------------------------
    def run(self, seconds: float, fault_every: float, rate: float,
            progress: Callable[[str], None] = lambda line: None) -> None:
        """`seconds` of Poisson load at `rate` requests/s with a fault every `fault_every` s; `progress` gets a
        line after each fault."""
        assert self.load is not None
        self.t0 = time.monotonic()
        self.load.start(rate)
        sampler = threading.Thread(target=self._sample_loop, daemon=True)
        sampler.start()
        end = self.t0 + seconds
        k = 0
        while True:
            at = self.t0 + (k + 1) * fault_every
            if at >= end or self._stop.wait(max(0.0, at - time.monotonic())):
                break
            self._inject(FAULTS[k % len(FAULTS)], k // len(FAULTS))
            f, results = self.faults[-1], self.load.results
            progress(f"{time.monotonic() - self.t0:.0f}/{seconds:.0f} s: {f.kind} {f.target} over in {f.took:.1f} s"
                     f"{' (' + f.error + ')' if f.error else ''}; {len(results)} requests sent, "
                     f"{sum(_failed(r) for r in results)} failed")
            k += 1
        self._stop.wait(max(0.0, end - time.monotonic()))

    def rolling_restart(self, settle: float = 30.0) -> None:
        """After `settle` s more of load without faults (the last fault's backlog served), every node drained
        and restarted, one at a time, while the load goes on; then the load stops."""
        assert self.launcher is not None and self.load is not None
        self._stop.wait(settle)
        started = time.monotonic()
        before = len(self.load.results)
        for proc in self.launcher.procs:
            self.launcher.restart(proc)
            self.nodes[proc.label].restarts.append(time.monotonic() - self.t0)
        during = self.load.results[before:len(self.load.results)]
        self.load.stop()
        self._stop.set()
        self.rolling = {"seconds": round(time.monotonic() - started, 1), "requests": len(during),
                        "failed": sum(map(_failed, during)), "lost": sum(r.lost for r in during)}

    def _procs(self, role: str) -> list[Proc]:
        assert self.launcher is not None
        return [p for p in self.launcher.procs if p.label.split("/")[1].startswith(role)]

    def _inject(self, kind: str, turn: int) -> None:
        assert self.launcher is not None
        launcher, wan = self.launcher, self.launcher.wan
        assert wan is not None
        now = time.monotonic()
        links = [(link.a, link.b) for link in launcher.topology.links]
        if kind in ("kill_core", "drain_core", "drain_edge"):
            proc = self._procs("edge" if kind == "drain_edge" else "core")[turn % 2]
            record = FaultRecord(now - self.t0, kind, proc.label)
        else:
            a, b = links[turn % len(links)]
            record = FaultRecord(now - self.t0, kind, f"{a}-{b}")
        self.faults.append(record)
        launcher.say(f"soak: {kind} {record.target} at {record.at:.0f} s")
        try:
            if kind == "kill_core":
                try:
                    launcher.kill(proc)
                    launcher.respawn(proc, now)
                finally:                  # a fresh process from here (its warm-up is not judged)
                    self.nodes[proc.label].restarts.append(time.monotonic() - self.t0)
            elif kind in ("drain_core", "drain_edge"):
                try:
                    launcher.restart(proc)
                finally:
                    self.nodes[proc.label].restarts.append(time.monotonic() - self.t0)
            elif kind == "cut_link":
                try:
                    wan.cut(a, b)
                    time.sleep(CUT_S)
                finally:
                    wan.cut(a, b, up=True)
            else:
                try:
                    wan.set_bandwidth(a, b, LINK_MBIT / 10)
                    time.sleep(SLOW_S)
                finally:
                    wan.set_bandwidth(a, b, LINK_MBIT)
        except Exception as exc:   # noqa: BLE001 - a fault that could not be injected or undone is reported
            record.error = f"{type(exc).__name__}: {exc}"
            launcher.say(f"soak: {kind} {record.target} failed: {record.error}")
        record.took = round(time.monotonic() - now, 2)

    def _sample_loop(self) -> None:
        assert self.launcher is not None
        while not self._stop.wait(SAMPLE_S):
            for proc in self.launcher.procs:
                url = proc.ready_url.rsplit("/", 1)[0] + "/metrics"
                self.nodes[proc.label].samples.append((time.monotonic() - self.t0, sample(proc.popen.pid, url)))

    # ---- the report -----------------------------------------------------------------------------
    def report(self, warmup_s: float = 60.0) -> dict:
        assert self.load is not None
        results = self.load.results
        causes: dict[str, int] = {}
        for r in results:
            if _failed(r) and r.error is not None:
                causes[r.error] = causes.get(r.error, 0) + 1
        return {
            "requests": {"sent": len(results), "completed": sum(r.error is None and not r.lost for r in results),
                         "failed": sum(map(_failed, results)),
                         "lost": sum(r.lost for r in results), "failed_by_cause": causes,
                         "retried": sum(r.retries > 0 for r in results)},
            "minutes": self._minutes(results),
            "faults": [asdict(f) for f in self.faults],
            "nodes": {label: _node_report(series, warmup_s) for label, series in self.nodes.items()},
            "rolling_restart": self.rolling,
        }

    def _minutes(self, results: list[Result]) -> list[dict]:
        rows: dict[int, list[Result]] = {}
        for r in results:
            rows.setdefault(int((r.sent - self.t0) // 60), []).append(r)
        out = []
        for minute in sorted(rows):
            ttfts = sorted(r.ttft for r in rows[minute] if r.ttft is not None)
            out.append({"minute": minute, "sent": len(rows[minute]),
                        "failed": sum(map(_failed, rows[minute])), "lost": sum(r.lost for r in rows[minute]),
                        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else None,
                        "ttft_p99_ms": round(1000 * _quantile(ttfts, 0.99), 1) if ttfts else None,
                        "faults": [f"{f.kind} {f.target}" for f in self.faults if int(f.at // 60) == minute]})
        return out


def _failed(r: Result) -> bool:
    """Answered with an error (a lost request, which had no answer, is counted apart)."""
    return r.error is not None and not r.lost


def _quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _node_report(series: NodeSeries, warmup_s: float) -> dict:
    """Per-minute medians of each resource after warm-up, and whether each is flat (see the module's doc).
    Minutes in which the node (re)started, or that began less than a minute after it did, are left out."""
    minutes: dict[int, list[NodeSample]] = {}
    for t, s in series.samples:
        fresh = any(0 <= t // 60 - r // 60 <= 1 for r in series.restarts)   # its minute, or the one after
        if t >= warmup_s and not fresh and s.rss_mb is not None:
            minutes.setdefault(int(t // 60), []).append(s)
    report: dict = {"restarts": len(series.restarts), "minutes": sorted(minutes)}
    pool = max((s.kv_pool or 0 for ss in minutes.values() for s in ss), default=0)
    for name in ("rss_mb", "fds", "threads", "kv_blocks"):
        medians = []
        for m in sorted(minutes):
            values = [getattr(s, name) for s in minutes[m] if getattr(s, name) is not None]
            medians.append(round(statistics.median(values), 1) if values else None)
        report[name] = medians
        known = [v for v in medians if v is not None]
        if len(known) < 2:
            report[f"{name}_flat"] = None             # too few minutes to judge
        elif name == "kv_blocks":
            report[f"{name}_flat"] = pool > 0 and (max(known) - min(known)) <= FLAT * pool
        else:
            report[f"{name}_flat"] = min(known) > 0 and max(known) / min(known) <= 1 + FLAT
    return report
