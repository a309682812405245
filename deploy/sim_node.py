"""The simulator's state: one request in flight (`Job`), one engine replica (`Node`), one link (`LinkState`).

Life cycle: deploy/simulator.py creates a `Node` per core and edge replica and a `LinkState` per core-region →
edge-region pair, and a `Job` per trace request as it arrives. At each event touching a node it calls
`advance(now)` (run the current mix until now: steps, the head prefill's tokens, busy time, queue area), then
changes the node (`enqueue_prefill`, `join`, `leave`) and `plan()`s its next event. A node's decode batch
needs no per-token state: every running request advances one token per engine step, so one fractional step
counter serves all; a request that joins at step s with k tokens to go finishes at step s + k (a heap of finish
steps), and Σ contexts = Σ (context at join − step at join) + rows × steps. Prefill is a FIFO of
[job, tokens left, context before them]; a step takes up to the step budget minus the decode rows of it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from edgecore.deploy.profile import CostModel, Profile
from edgecore.deploy.trace import Request

BLOCK = 16          # prefix caches reuse whole blocks (CacheConfig.block_size)
_KEYS = itertools.count(1)      # decode batch entries (an entry whose key is not its job's is stale)


class Job:
    """One request in flight."""
    __slots__ = ("req", "region", "edge", "core", "arrive", "ttft", "done", "where", "cached", "tokens",
                 "epoch", "attempts", "tried", "codec", "kv_at", "phase", "run_key", "join", "run_node", "core_cached")

    def __init__(self, req: Request, region: int):
        self.req, self.region = req, region
        self.edge: Node | None = None
        self.core: Node | None = None
        self.arrive = req.t
        self.ttft = -1.0
        self.done = -1.0
        self.where = ""              # local | remote | cache | failed
        self.cached = 0              # edge-cached prefix tokens
        self.core_cached = 0         # tokens its core had cached
        self.tokens = 0              # output tokens produced so far
        self.epoch = 0               # bumped when a failure invalidates the job's pending events
        self.attempts = 0
        self.tried: set[str] = set()
        self.codec = ""
        self.kv_at = -1.0
        self.phase = ""
        self.run_key = -1            # its decode batch entry (-1: not in a batch)
        self.join = 0.0              # step of its node when it joined that batch
        self.run_node: Node | None = None


class Node:
    __slots__ = ("name", "base", "kind", "region", "cost", "alive", "budget", "max_seqs", "kv_cap", "steps", "last",
                 "step_time", "pref_rate", "running", "nrun", "ctx_base", "prefill", "queued", "waiting", "kv_used",
                 "version", "busy", "queue_area", "queue_peak", "served", "sessions", "session_tokens", "jobs",
                 "enqueued", "dequeued", "codecs", "inflight", "hold", "slow", "threads")

    def __init__(self, name: str, base: str, kind: str, region: str, profile: Profile, codecs: tuple[str, ...] = ()):
        self.name, self.base, self.kind, self.region = name, base, kind, region
        self.cost: CostModel = profile.cost
        self.alive = True
        self.budget, self.max_seqs, self.kv_cap = (profile.max_num_batched_tokens, profile.max_num_seqs,
                                                   profile.kv_capacity_tokens)
        self.steps = 0.0             # engine steps so far (fractional between events)
        self.last = 0.0
        self.step_time = 0.0         # of the current mix; 0 when idle
        self.pref_rate = 0.0         # prefill tokens per step in the current mix
        self.running: list[tuple[float, int, Job]] = []      # heap: (finish step, key, job)
        self.nrun = 0
        self.ctx_base = 0.0          # Σ over running of (context at join − step at join)
        self.prefill: deque[list] = deque()     # [job, tokens left, context before them]
        self.queued = 0.0            # prefill tokens queued
        self.waiting: deque[tuple[Job, int]] = deque()      # decode admission: (job, tokens to go)
        self.kv_used = 0
        self.version = 0
        self.busy = 0.0
        self.queue_area = 0.0
        self.queue_peak = 0
        self.served = 0
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.session_tokens = 0
        self.jobs: set[Job] = set()
        self.enqueued = 0
        self.dequeued = 0
        self.codecs = codecs
        self.inflight: dict[str, int] = {}     # an edge's requests in flight per core (the router's load)
        self.hold = False            # inside its own event: re-planned once at the end
        self.slow = 1.0              # its steps' stretch while nodes sharing its machine's cores are busy too
        self.threads = max(1, int(profile.machine.get("torch_threads") or 1))   # cores one step keeps busy

    @property
    def working(self) -> bool:
        """Whether it has steps to run (decodes or prefills)."""
        return self.alive and bool(self.nrun or self.prefill)

    def queue_len(self) -> int:
        return len(self.prefill) + len(self.waiting)

    def load(self) -> int:
        return self.nrun + len(self.prefill) + len(self.waiting)

    def cached_for(self, req: Request) -> int:
        if not req.session or not req.prefix_tokens:
            return 0
        have = self.sessions.get(req.session, 0)
        if have:
            self.sessions.move_to_end(req.session)
        return min(req.prefix_tokens, have) // BLOCK * BLOCK

    def remember(self, req: Request, tokens: int) -> None:
        if not req.session:
            return
        self.session_tokens += tokens - self.sessions.pop(req.session, 0)
        self.sessions[req.session] = tokens
        while self.session_tokens > self.kv_cap and self.sessions:
            self.session_tokens -= self.sessions.popitem(last=False)[1]

    # ---- the engine's arithmetic (deploy/simulator.py calls these at its events) ----------------------
    def advance(self, now: float) -> None:
        """Run the current mix until `now`: decode steps and the head prefill's progress, busy time, queue."""
        dt = now - self.last
        if dt <= 0:
            return
        self.queue_area += dt * self.queue_len()
        if self.step_time > 0:
            self.busy += dt
            ds = dt / self.step_time
            self.steps += ds
            if self.prefill and self.pref_rate > 0:
                head = self.prefill[0]
                done = min(head[1], ds * self.pref_rate)
                head[1] -= done
                head[2] += done
                self.queued = max(0.0, self.queued - done)
        self.last = now

    def plan(self) -> float | None:
        """The new mix's step time; seconds until its next prefill or decode ends (None: idle)."""
        self.version += 1
        rows = self.nrun
        if not self.alive or not rows and not self.prefill:
            self.step_time = 0.0
            return None
        start = 0.0
        self.pref_rate = 0.0
        if self.prefill:
            self.pref_rate = max(1.0, min(self.budget - rows, self.queued))
            start = self.prefill[0][2]
        step = max(self.cost.step(rows, self.ctx_base + rows * self.steps, self.pref_rate, start) * self.slow, 1e-9)
        self.step_time = step
        when = math.inf
        if self.prefill:
            when = self.prefill[0][1] / self.pref_rate * step
        if self.running:
            when = min(when, max(0.0, self.running[0][0] - self.steps) * step)
        return when

    def enqueue_prefill(self, job: Job, tokens: int, context: int) -> None:
        self.prefill.append([job, float(max(tokens, 1)), float(context)])
        self.queued += max(tokens, 1)
        self.enqueued += 1
        self.jobs.add(job)
        self.queue_peak = max(self.queue_peak, self.queue_len())

    def join(self, job: Job, tokens: int) -> None:
        """Decode `tokens` more tokens of `job` here (or wait for a row and KV room)."""
        need = job.req.prompt_tokens + job.req.output_tokens
        if self.nrun >= self.max_seqs or self.kv_used + need > self.kv_cap and self.nrun:
            self.waiting.append((job, tokens))
            self.enqueued += 1
            self.queue_peak = max(self.queue_peak, self.queue_len())
        else:
            self._start(job, tokens)

    def _start(self, job: Job, tokens: int) -> None:
        key = next(_KEYS)
        job.run_key = key
        context = job.req.prompt_tokens + job.tokens
        heapq.heappush(self.running, (self.steps + tokens, key, job))
        self.nrun += 1
        self.ctx_base += context - self.steps
        self.kv_used += job.req.prompt_tokens + job.req.output_tokens
        self.jobs.add(job)
        job.join, job.run_node = self.steps, self

    def drop_waiting(self, job: Job) -> None:
        """Take `job` out of the queue for a decode row (it moved elsewhere before it got one)."""
        for i, (waiting, _) in enumerate(self.waiting):
            if waiting is job:
                del self.waiting[i]
                self.dequeued += 1
                return

    def leave(self, job: Job) -> int:
        """Take `job` out of the decode batch (admitting waiting ones): the tokens it decoded here."""
        decoded = int(self.steps - job.join + 1e-6)
        context = job.req.prompt_tokens + job.tokens
        self.nrun -= 1
        self.ctx_base -= context - job.join
        self.kv_used -= job.req.prompt_tokens + job.req.output_tokens
        job.run_key, job.run_node = -1, None
        if self.kind == "core":
            self.jobs.discard(job)
        while self.waiting and self.nrun < self.max_seqs and (
                self.kv_used + self.waiting[0][0].req.prompt_tokens + self.waiting[0][0].req.output_tokens
                <= self.kv_cap or not self.nrun):
            waiting, tokens = self.waiting.popleft()
            self.dequeued += 1
            self._start(waiting, tokens)
        return decoded


@dataclass
class LinkState:
    a: str                       # core region
    b: str                       # edge region
    delay: float                 # seconds one way
    bps: float | None            # bytes per second (None: not limited)
    free_at: float = 0.0
    bytes: float = 0.0
    transfers: int = 0
    windows: dict[int, float] = field(default_factory=dict)     # second → bytes sent in it
    codecs: dict[str, int] = field(default_factory=dict)

    def send(self, ready: float, seconds: float, nbytes: float, until: float) -> float:
        """A transfer of `seconds` that may start at `ready` and ends no sooner than `until`: its end."""
        start = max(ready, self.free_at)
        end = max(start + seconds, until)
        self.free_at = end
        self.bytes += nbytes
        self.transfers += 1
        span = max(end - start, 1e-9)
        w = int(start)
        while w < end:
            part = min(end, w + 1) - max(start, w)
            self.windows[w] = self.windows.get(w, 0.0) + nbytes * part / span
            w += 1
        return end
