"""The fleet simulator behind `edgecore plan`: a discrete-event model of cores, edges and the WAN links.

Life cycle: `Simulator(topology, profile, core_profile, options)` builds one `Node` per replica of each core
and edge (each with its engine's cost model from a profile, deploy/profile.py) and one `LinkState` per
(core region, edge region) pair; `run(trace)` replays the requests through a heap of timed events and returns
a `Result` (per request: where it was prefilled, TTFT, end-to-end time; per node: busy time, queue; per link:
bytes, peak rate). deploy/plan.py turns a result into the report.

What a node does between events is arithmetic, not events per token (deploy/sim_node.py): a node's state is
its decode batch (every running request advances one token per engine step, so one step counter serves them
all), its FIFO of prefill work (chunked prefill: each step takes up to the step budget minus the decode rows
of prefill tokens), and the step time that the cost model gives for that mix. Any event at a node first
advances it to now, then re-plans its next event (the next prefill or decode to finish), so time per token
follows the batch as it changes.

The nodes' own policy code decides, as on the real edge: `PrefillModel.local_is_faster` (edge/placement.py:
the fixed `local_prefill_below` threshold, or with `auto` the measured crossover, fed the simulated TTFTs),
`choose_codec` and `transfer_estimate` (edge/codec_policy.py, over the profile's codec table); cores are
ranked as an edge ranks cores without prefix digests (`pick`: round trip and load). A request's path: placement at the least loaded
live edge of its region, then either a local prefill, or a remote one: the request crosses the link, the
core prefills it, its KV streams layer by layer on the link (FIFO per link: the transfer starts once the
first layer is computed and the link is free, and takes the codec's `transfer_estimate`), the first token
returns one delay later; with decode handover the core decodes (up to `handover_tokens`) until the KV is
complete at the edge, which then decodes the rest. A node removed at time t (`failures`) fails what it
holds: the edge retries another core (at most `max_core_attempts`) or prefills locally, as it does; an
edge's own requests fail (counted, never lost). Prefix caches: per node, the context of each session's
last request (LRU within the KV capacity); a request's `prefix_tokens` reuse it in whole blocks. A profile's
serving terms (`edgecore profile --serving`: what a client sees beyond the engines' work) are added to each
served request's first token and to each later token.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import cast

from edgecore.deploy.profile import Profile
from edgecore.deploy.sim_node import Job, LinkState, Node
from edgecore.deploy.topology import TopologyCore, TopologyEdge, Topology, TopologyError
from edgecore.deploy.trace import Trace
from edgecore.edge.codec_policy import CURVE, DEFAULT_QUALITY_BUDGET, CurvePoint, choose_codec, transfer_estimate
from edgecore.edge.placement import PrefillModel



@dataclass(frozen=True)
class Options:
    local_prefill_below: int | None = 32     # the edge's --local-prefill-below (None: auto, measured)
    handover_tokens: int = 64                # 0: no decode handover
    adaptive: bool = False                   # the edge's --adaptive codec choice
    ttft_target_ms: float | None = None
    quality_budget: float = DEFAULT_QUALITY_BUDGET
    max_core_attempts: int = 2
    failures: tuple[tuple[str, float], ...] = ()      # (node name, seconds)
    replicas: dict[str, int] = field(default_factory=dict)   # node name → replicas (default: the topology's)
    # every node on one machine of this many cores, as `edgecore up` runs a topology (None: each node on its own
    # machine, as profiled): while k nodes have steps to run, each step takes max(1, k x threads / cores) times
    # the profile's time (threads: the profile's torch threads)
    shared_cpus: int | None = None


@dataclass
class Result:
    jobs: list[Job]
    nodes: list[Node]
    links: dict[tuple[str, str], LinkState]
    duration: float
    regions: tuple[str, ...]


ARRIVE, NODE, AT_CORE, KV_READY, FAIL, DONE = range(6)


class Simulator:
    def __init__(self, topology: Topology, profile: Profile, core_profile: Profile | None = None,
                 options: Options | None = None):
        self.topo = topology
        self.opt = options or Options()
        self.profile = profile
        self.core_profile = core_profile or profile
        self.curve = self._curve(profile)
        self.nodes: list[Node] = []
        self.edges_in: dict[str, list[Node]] = {}
        self.cores_in: dict[str, list[Node]] = {}
        for spec in topology.cores:
            for r in range(self.opt.replicas.get(spec.name, spec.replicas)):
                node = Node(_replica(spec, r), spec.name, "core", spec.region, self.core_profile)
                self.nodes.append(node)
                self.cores_in.setdefault(spec.region, []).append(node)
        for espec in topology.edges:
            allowed = tuple(c for c in espec.codecs if c in self.curve) or ("lossless",)
            for r in range(self.opt.replicas.get(espec.name, espec.replicas)):
                node = Node(_replica(espec, r), espec.name, "edge", espec.region, profile, allowed)
                self.nodes.append(node)
                self.edges_in.setdefault(espec.region, []).append(node)
        self.links: dict[tuple[str, str], LinkState] = {}
        self.specs = {}                 # region pair → its link (the first listed, as Topology.link)
        for spec_link in reversed(topology.links):
            self.specs[frozenset((spec_link.a, spec_link.b))] = spec_link
        self.reach: dict[str, list[tuple[Node, LinkState]]] = {}
        for region in self.edges_in:
            pairs = []
            for core_region, cores in self.cores_in.items():
                link = self._link(core_region, region)
                if link is not None:
                    pairs += [(c, link) for c in cores]
            if not pairs:
                raise TopologyError(f"{topology.path}: region {region!r} has edges but no core it can reach "
                                    f"(no core in the region and no [[links]] entry to a region with cores)")
            self.reach[region] = pairs
        self.models: dict[str, PrefillModel] = {}
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.working: set[Node] = set()      # with `shared_cpus`: the nodes that have steps to run

    def _curve(self, profile: Profile) -> dict[str, CurvePoint]:
        """The codec policy's curve with this machine's ratio and speeds (quality as bench/kv_rd.py measured)."""
        curve = dict(CURVE)
        for name, c in profile.codecs.items():
            ref = CURVE.get(name)
            curve[name] = CurvePoint(c.ratio, ref.ppl_increase if ref else 0.0, ref.agreement if ref else 1.0,
                                     c.encode_bps, c.decode_bps)
        return curve

    def _link(self, core_region: str, edge_region: str) -> LinkState | None:
        key = (core_region, edge_region)
        if key in self.links:
            return self.links[key]
        if core_region == edge_region:
            state = LinkState(core_region, edge_region, 0.0, None)
        else:
            spec = self.specs.get(frozenset((core_region, edge_region)))
            if spec is None:
                return None
            state = LinkState(core_region, edge_region, spec.delay_ms / 1000,
                              spec.bandwidth_mbit * 125000 if spec.bandwidth_mbit else None)
        self.links[key] = state
        return state

    # ---- events ------------------------------------------------------------------------------------------
    def push(self, t: float, kind: int, obj: object, tag: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj, tag))

    def run(self, trace: Trace) -> Result:
        """Simulate the trace (the cyclic garbage collector paused meanwhile: with millions of live jobs its
        full passes made the run superlinear, and the run makes no cyclic garbage worth collecting)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(trace)
        finally:
            if enabled:
                gc.enable()

    def _run(self, trace: Trace) -> Result:
        regions = {r: i for i, r in enumerate(self.topo.regions)}
        for region in trace.regions():
            if region not in self.edges_in:
                raise TopologyError(f"the trace sends requests to region {region!r}, which has no edge in "
                                    f"{self.topo.path}")
        jobs = [Job(req, regions[req.region]) for req in trace.requests]
        for name, at in self.opt.failures:
            hit = [n for n in self.nodes if n.base == name or n.name == name]
            if not hit:
                raise TopologyError(f"--fail names unknown node {name!r}")
            for node in hit:
                self.push(at, FAIL, node)
        arrivals = iter(jobs)
        nxt = next(arrivals, None)
        events = self.events
        while events or nxt is not None:
            if nxt is not None and (not events or nxt.arrive <= events[0][0]):
                self.now = nxt.arrive
                self.arrive(nxt)
                nxt = next(arrivals, None)
                continue
            t, _, kind, obj, tag = heapq.heappop(events)
            if t == math.inf:
                raise RuntimeError(f"simulator: an event at infinite time ({obj!r}): a node's state is inconsistent")
            self.now = t
            if isinstance(obj, Node):
                if kind == FAIL:
                    self.fail(obj)
                elif tag == obj.version and obj.alive:
                    self.node_event(obj)
            else:
                job = cast(Job, obj)
                if tag != job.epoch:
                    continue
                if kind == AT_CORE:
                    self.at_core(job)
                elif kind == KV_READY:
                    self.kv_ready(job)
                elif kind == DONE:
                    self.finish(job)
        end = max([j.done for j in jobs] + [trace.duration, 1e-9])
        for node in self.nodes:
            if node.alive:
                node.advance(end)
        return Result(jobs, self.nodes, self.links, end, tuple(self.topo.regions))

    # ---- a node's engine ---------------------------------------------------------------------------------
    def replan(self, node: Node) -> None:
        if node.hold:
            return
        if self.opt.shared_cpus and node.working != (node in self.working):
            self._share(node)
        when = node.plan()
        if when is not None:
            self.push(self.now + when, NODE, node, node.version)

    def _share(self, node: Node) -> None:
        """`node` starts or stops having work on a shared machine: every working node's steps stretch or shrink
        with the cores' demand from now on (each runs at its old pace until now, then is re-planned)."""
        assert self.opt.shared_cpus
        (self.working.add if node.working else self.working.discard)(node)
        demand = sum(n.threads for n in self.working)
        slow = max(1.0, demand / self.opt.shared_cpus)
        for other in self.working:
            if other.slow != slow:
                other.advance(self.now)
                other.slow = slow
                if other is not node:
                    when = other.plan()
                    if when is not None:
                        self.push(self.now + when, NODE, other, other.version)
        node.slow = slow

    def node_event(self, node: Node) -> None:
        node.advance(self.now)
        node.hold = True
        while node.prefill and node.prefill[0][1] <= 1e-6:
            job = node.prefill.popleft()[0]
            node.dequeued += 1
            self.prefilled(node, job)
        while node.running and node.running[0][0] <= node.steps + 1e-6:
            _, key, job = heapq.heappop(node.running)
            if key != job.run_key:
                continue                 # moved away (handover) or failed: already out of the counts
            node.leave(job)
            self.decoded(node, job)
        node.hold = False
        self.replan(node)

    def enqueue_prefill(self, node: Node, job: Job, tokens: int, context: int) -> None:
        node.advance(self.now)
        node.enqueue_prefill(job, tokens, context)
        self.replan(node)

    def join_batch(self, node: Node, job: Job, tokens: int) -> None:
        node.advance(self.now)
        node.join(job, tokens)
        self.replan(node)

    # ---- a request's path --------------------------------------------------------------------------------
    def arrive(self, job: Job) -> None:
        edges = [e for e in self.edges_in[job.req.region] if e.alive]
        if not edges:
            job.where, job.done = "failed", self.now
            return
        edge = min(edges, key=Node.load)
        job.edge = edge
        edge.jobs.add(job)
        job.cached = edge.cached_for(job.req)
        self.place(job)

    def place(self, job: Job) -> None:
        edge = job.edge
        assert edge is not None
        uncached = job.req.prompt_tokens - job.cached
        best = self.pick(job)
        model = self.models.setdefault(edge.name, PrefillModel(self.opt.local_prefill_below or 32))
        if best is None or job.attempts >= self.opt.max_core_attempts:
            self.local(job, "local")
            return
        core, link = best
        if self.opt.local_prefill_below == 0:
            local = False
        else:
            local = model.local_is_faster(uncached, core.name, model.predict_core(core.name, 2 * link.delay, uncached, 0))
        if local:
            self.local(job, "cache" if job.cached else "local")
            return
        job.where, job.core, job.attempts = "remote", core, job.attempts + 1
        job.tried.add(core.name)
        edge.inflight[core.name] = edge.inflight.get(core.name, 0) + 1
        self.push(self.now + link.delay, AT_CORE, job, job.epoch)

    def pick(self, job: Job) -> tuple[Node, LinkState] | None:
        """The core to try: the least round trip inflated by its load (the edge's ranking of cores that send no
        prefix digests, `--core-routing rtt`; the simulator models no core prefix caches, so it does not
        predict as edge/core_choice.py does)."""
        edge = job.edge
        assert edge is not None
        best, score = None, math.inf
        inflight = edge.inflight
        for pair in self.reach[edge.region]:
            core = pair[0]
            if core.alive and core.name not in job.tried:      # load: in flight from this edge + the core's queue
                s = _rtt_score(2 * pair[1].delay, inflight.get(core.name, 0) + core.nrun + len(core.prefill)
                               + len(core.waiting))
                if s < score:
                    best, score = pair, s
        return best

    def local(self, job: Job, where: str) -> None:
        edge = job.edge
        assert edge is not None
        job.where, job.core = where, None
        job.phase = "local"
        self.enqueue_prefill(edge, job, job.req.prompt_tokens + job.tokens - job.cached, job.cached)

    def at_core(self, job: Job) -> None:
        core = job.core
        assert core is not None
        if not core.alive:
            self.core_failed(job)
            return
        job.core_cached = core.cached_for(job.req)     # the core computes what its own cache lacks (attention
        job.phase = "prefill"                          # needs the whole prefix); it sends what the edge lacks
        self.enqueue_prefill(core, job, job.req.prompt_tokens - job.core_cached, job.core_cached)

    def prefilled(self, node: Node, job: Job) -> None:
        """`node` computed the job's prompt: the first token is sampled there."""
        req = job.req
        if node.kind == "edge":
            if job.ttft < 0:
                job.ttft = self.now
                self._observe_local(job)
            job.tokens = max(job.tokens, 1)
            if job.tokens >= req.output_tokens:
                self.finish(job)
            else:
                self.join_batch(node, job, req.output_tokens - job.tokens)
            return
        node.jobs.discard(job)
        edge = job.edge
        assert edge is not None
        link = self.links[(node.region, edge.region)]
        node.remember(req, req.prompt_tokens)
        raw = (req.prompt_tokens - job.cached) * self.profile.kv_wire_bytes_per_token
        job.codec = self._codec(edge, raw, link)
        link.codecs[job.codec] = link.codecs.get(job.codec, 0) + 1
        ratio = self.curve[job.codec].ratio
        seconds = transfer_estimate(job.codec, raw, link.bps or 1e18, self.curve)
        compute = node.cost.prefill(req.prompt_tokens - job.core_cached, job.core_cached, node.budget)
        layers = max(1, self.profile.layers)
        end = link.send(self.now - compute + compute / layers, seconds, raw * ratio, self.now + seconds / layers)
        job.kv_at = end + link.delay
        first_at = self.now + link.delay
        job.tokens = max(job.tokens, 1)
        if self.opt.handover_tokens and job.ttft < 0:
            job.ttft = first_at           # PrefillDone: the client sees the core's first token at once
        if self.opt.handover_tokens and req.output_tokens > job.tokens:
            job.phase = "handover"
            self.join_batch(node, job, min(self.opt.handover_tokens, req.output_tokens - job.tokens))
        elif self.opt.handover_tokens:
            self.push(first_at, DONE, job, job.epoch)     # it ended with the first token: it never moves
        self.push(max(job.kv_at, first_at), KV_READY, job, job.epoch)

    def _codec(self, edge: Node, raw: int, link: LinkState) -> str:
        if not self.opt.adaptive:
            return edge.codecs[0]
        target = self.opt.ttft_target_ms / 1000 if self.opt.ttft_target_ms else None
        return choose_codec(list(edge.codecs), raw, link.bps, target, self.opt.quality_budget, self.curve)

    def kv_ready(self, job: Job) -> None:
        """The whole KV is at the edge: Ack (or Handover) to the core; the edge decodes the rest."""
        core, edge = job.core, job.edge
        assert core is not None and edge is not None
        edge.inflight[core.name] -= 1
        if self.opt.local_prefill_below is None:
            model = self.models[edge.name]
            rtt = 2 * self.links[(core.region, edge.region)].delay
            model.observe_remote(core.name, job.req.prompt_tokens - job.cached, self.now - job.arrive, rtt)
        if job.ttft < 0:
            job.ttft = self.now
        if job.done >= 0:
            return
        if job.run_node is core:          # Handover: the core stops, the edge takes over
            core.advance(self.now)
            job.tokens += core.leave(job)
            self.replan(core)
        elif job.phase == "handover":     # still waiting for a row at the core: it never decodes there
            core.drop_waiting(job)
        job.phase = "edge"
        if job.tokens >= job.req.output_tokens:
            self.finish(job)
        else:
            self.join_batch(edge, job, job.req.output_tokens - job.tokens)

    def decoded(self, node: Node, job: Job) -> None:
        """`job` decoded its tokens on `node` (the edge: the end; a core: its handover share)."""
        job.tokens += int(node.steps - job.join + 1e-6)
        if node.kind == "edge":
            self.finish(job)
            return
        job.phase = "handover-done"
        if job.tokens >= job.req.output_tokens:       # ended at the core: it never moves
            edge = job.edge
            assert edge is not None
            self.push(self.now + self.links[(node.region, edge.region)].delay, DONE, job, job.epoch)

    def finish(self, job: Job) -> None:
        if job.done >= 0:
            return
        job.tokens = job.req.output_tokens
        # what the client sees beyond the engines' work: the serving path (the profile's `--serving` terms)
        job.ttft += self.profile.serving_ttft_s
        job.done = self.now + self.profile.serving_ttft_s + self.profile.serving_tpot_s * max(0, job.tokens - 1)
        edge = job.edge
        if edge is not None:
            edge.jobs.discard(job)
            edge.served += 1
            edge.remember(job.req, job.req.prompt_tokens + job.req.output_tokens)
        if job.core is not None:
            job.core.served += 1

    def _observe_local(self, job: Job) -> None:
        if self.opt.local_prefill_below is None and job.edge is not None:
            self.models[job.edge.name].observe_local(job.req.prompt_tokens - job.cached, self.now - job.arrive)

    # ---- failures ----------------------------------------------------------------------------------------
    def fail(self, node: Node) -> None:
        node.advance(self.now)
        node.alive = False
        for _, key, job in node.running:      # tokens a core decoded before it died reached the edge
            if key != job.run_key:
                continue                  # a stale entry: the job runs elsewhere now
            if node.kind == "core":
                job.tokens += int(node.steps - job.join + 1e-6)
            job.run_key, job.run_node = -1, None
        held = list(node.jobs) + [p[0] for p in node.prefill] + [w[0] for w in node.waiting]
        held += [j for j in self._pending_kv(node)]
        node.prefill.clear()
        node.waiting.clear()
        node.running.clear()
        node.nrun, node.ctx_base, node.queued, node.kv_used = 0, 0.0, 0.0, 0
        node.jobs.clear()
        self.replan(node)
        for job in dict.fromkeys(held):
            if job.done >= 0:
                continue
            job.epoch += 1
            if node.kind == "edge":
                job.where, job.done = "failed", self.now
                node.dequeued += 1
                continue
            edge = job.edge
            assert edge is not None
            delay = self.links[(node.region, edge.region)].delay
            self.push(self.now + delay, AT_CORE, job, job.epoch)     # the edge sees the connection close

    def _pending_kv(self, core: Node) -> list[Job]:
        """Jobs whose KV from `core` is still on its way (prefill done, not Acked)."""
        return [j for e in self.nodes if e.kind == "edge" for j in e.jobs
                if j.core is core and j.kv_at > self.now and j.done < 0]

    def core_failed(self, job: Job) -> None:
        """The edge learns its core failed before the KV was complete: retry elsewhere, else prefill here."""
        edge, core = job.edge, job.core
        assert edge is not None and core is not None
        edge.inflight[core.name] -= 1
        if not edge.alive or job.done >= 0:
            return
        if job.tokens:                    # it had decoded k tokens: the edge computes the rest itself
            self.local(job, "local")
        else:
            self.place(job)


def _replica(spec: TopologyCore | TopologyEdge, r: int) -> str:
    return spec.name if r == 0 else f"{spec.name}#{r}"


def _rtt_score(rtt: float, load: int) -> float:
    """A core's rank, lowest first: the round trip inflated by the requests in flight."""
    return rtt * (1 + load) + 0.001 * load
