"""Running one engine step across tensor- and pipeline-parallel ranks.

Life cycle per step: the driver (rank 0, which owns the scheduler) encodes the
scheduled items (`step_plan`) and broadcasts them; every rank rebuilds the
same attention metadata with `ModelRunner.prepare`; stage 0 embeds, each stage
runs its layers (its TP group all-reducing inside each block) and sends the
hidden states to the next stage; the last stage computes the logits of the
sampling rows and its TP rank 0 sends them to the driver, which samples.
With several stages a step is split into micro-batches (whole sequences,
similar token counts): a stage sends a micro-batch's hidden states without
waiting and starts the next one, so the stages work at the same time.
Each rank can stream the K/V it computes itself: the driver keeps the routes
of requests whose edge is attached to every rank (`add_route`/`drop_route`)
and sends each route once, with the first step plan that computes it; every
rank's layer hook then sees the request id on its items. Otherwise
`read_kv` gathers a request's K/V from every rank (each holds some layers and
some KV heads) after the prefill and returns the pieces with their layer and
head offsets, so the edge can reassemble any layout. `worker_loop` is the
other ranks' side; STOP ends it.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist

from edgecore.shared.engine.model_runner import ModelRunner, sampling_rows
from edgecore.shared.engine.sampler import sample
from edgecore.shared.engine.step_plan import (READ_KV, STATS, STEP, STOP, ReadKVPayload, StepPayload, StepRoutes,
                                     decode_plan, encode_read_kv, encode_stats, encode_step, encode_stop)
from edgecore.shared.kv.heads import kv_head_start  # noqa: F401  (the partition rule; core/ranks.py imports it here)
from edgecore.shared.kv.transfer import DirectRoute
from edgecore.shared.models.layers import weight_bytes
from edgecore.shared.models.parallel import Layout

if TYPE_CHECKING:
    from edgecore.shared.engine.model_runner import StepSeq
    from edgecore.shared.engine.sampler import SampleResult
    from edgecore.shared.engine.scheduler import ScheduledBatch
    from edgecore.shared.engine.sequence import Sequence
    from edgecore.shared.kv.pool import KVPool
    from edgecore.shared.models.llama import LlamaForCausalLM


class StageRunner(ModelRunner):
    """A rank's part of a step (used directly by worker ranks, extended by the driver)."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, sliding_window: int | None, layout: Layout,
                 total_kv_heads: int) -> None:
        super().__init__(model, pool, sliding_window)
        self.layout = layout
        self.total_kv_heads = total_kv_heads
        self.hidden_size = model.config.hidden_size
        self.dtype = next(model.parameters()).dtype
        self.busy = 0.0            # seconds spent computing this rank's part of steps
        self.steps = 0
        self.layer0_macs_per_token = 0   # layer 0 of a parallel model spans ranks: its KV is never computed alone

    def execute(self, items: list[tuple[StepSeq, int]], on_layer: Callable[[int, list], None] | None = None
                ) -> tuple[list[StepSeq], torch.Tensor | None]:
        """Run this rank's part of a step; `on_layer(layer, items)` sees each micro-batch's own items."""
        started = time.perf_counter()
        try:
            return self._execute(items, on_layer)
        finally:
            self.busy += time.perf_counter() - started
            self.steps += 1

    def stats_vector(self) -> torch.Tensor:
        params = weight_bytes(self.model)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return torch.tensor([self.layout.rank, params, rss, int(self.busy * 1e6), self.steps], dtype=torch.long)

    def micro_batches(self, items: list[tuple[StepSeq, int]]) -> list[list[tuple[StepSeq, int]]]:
        """Split a step into up to `layout.micro_batches` micro-batches of similar token counts (whole sequences each), so
        that stage s works on micro-batch i while stage s+1 works on micro-batch i-1."""
        count = min(self.layout.micro_batches, len(items)) if self.layout.pp > 1 else 1
        if count <= 1:
            return [list(items)]
        groups: list[list[tuple[StepSeq, int]]] = [[] for _ in range(count)]
        loads = [0] * count
        for item in sorted(items, key=lambda it: -it[1]):
            i = loads.index(min(loads))
            groups[i].append(item)
            loads[i] += item[1]
        order = {id(seq): k for k, (seq, _) in enumerate(items)}
        return [sorted(g, key=lambda it: order[id(it[0])]) for g in groups if g]

    @torch.inference_mode()
    def _execute(self, items: list[tuple[StepSeq, int]], on_layer: Callable[[int, list], None] | None = None
                 ) -> tuple[list[StepSeq], torch.Tensor | None]:
        lay = self.layout
        last_driver = lay.rank_of(lay.pp - 1, 0)
        pending: list = []                  # isend handles (torch.distributed.Work)
        results: list[tuple[list[StepSeq], torch.Tensor | None]] = []
        for group in self.micro_batches(items):
            hook = (lambda layer, g=group: on_layer(layer, g)) if on_layer is not None else None
            ordered, ids, positions, meta = self.prepare(group, hook)
            hidden = None
            if lay.stage > 0:
                hidden = torch.empty(len(ids), self.hidden_size, dtype=self.dtype)
                dist.recv(hidden, src=lay.rank_of(lay.stage - 1, lay.tp_rank))
            hidden = self.model(ids, positions, meta, hidden=hidden)
            rows, samplers = sampling_rows(ordered)
            logits = None
            if lay.stage < lay.pp - 1:      # hand on and go straight to the next micro-batch
                pending.append(dist.isend(hidden.contiguous(), dst=lay.rank_of(lay.stage + 1, lay.tp_rank)))
            elif rows:
                logits = self.model.compute_logits(hidden[rows])
                if lay.pp > 1 and lay.rank == last_driver:
                    pending.append(dist.isend(logits.contiguous(), dst=0))
            results.append((samplers, logits))
        for handle in pending:
            handle.wait()
        samplers = [s for sampled, _ in results for s in sampled]
        if lay.pp > 1 and lay.rank == 0:    # the last stage's logits, micro-batch by micro-batch
            parts = []
            for sampled, _ in results:
                if sampled:
                    part = torch.empty(len(sampled), self.model.config.vocab_size, dtype=torch.float32)
                    dist.recv(part, src=last_driver)
                    parts.append(part)
            return samplers, torch.cat(parts) if parts else None
        computed = [lg for _, lg in results if lg is not None]
        return samplers, torch.cat(computed) if computed else None

    def local_kv(self, blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K, V for tokens [start, end): [local layers, tokens, local heads, head_dim]."""
        slots = self.pool.slots(blocks, start, end)
        ks, vs = zip(*(self.pool.read(layer, slots) for layer in range(len(self.pool.k))))
        return torch.stack(ks), torch.stack(vs)


class ParallelModelRunner(StageRunner):
    """The driver's runner: same interface as `ModelRunner.run`."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, sliding_window: int | None, layout: Layout,
                 total_kv_heads: int) -> None:
        super().__init__(model, pool, sliding_window, layout, total_kv_heads)
        self._lock = threading.Lock()
        self._routes: dict[str, DirectRoute] = {}   # stream id → route, until the ranks have it
        self._announced: set[str] = set()
        self._drops: list[str] = []

    def add_route(self, stream_id: str, route: DirectRoute) -> None:
        """Have every rank stream its own KV of request `stream_id` (any thread; before the request is added)."""
        with self._lock:
            self._routes[stream_id] = route

    def drop_route(self, stream_id: str) -> None:
        with self._lock:
            self._routes.pop(stream_id, None)
            if stream_id in self._announced:
                self._announced.discard(stream_id)
                self._drops.append(stream_id)

    def _step_routes(self, items: list[tuple[Sequence, int]]) -> StepRoutes | None:
        with self._lock:
            if not self._routes and not self._drops:
                return None
            routes = StepRoutes(drop=self._drops)
            self._drops = []
            for index, (seq, n) in enumerate(items):
                route = self._routes.get(seq.request_id)
                if route is None:
                    continue
                routes.ids[index] = seq.request_id
                if seq.request_id not in self._announced:
                    routes.new[seq.request_id] = route
                    self._announced.add(seq.request_id)
                if seq.num_computed_tokens + n >= seq.num_tokens:     # last chunk: the ranks forget it after
                    self._routes.pop(seq.request_id)
                    self._announced.discard(seq.request_id)
            return routes

    def _broadcast(self, plan: torch.Tensor) -> None:
        dist.broadcast(torch.tensor([plan.numel()], dtype=torch.long), 0)
        dist.broadcast(plan, 0)

    def run(self, batch: ScheduledBatch, on_layer: Callable[[int, list], None] | None = None
            ) -> tuple[list[Sequence], SampleResult | None]:
        self._broadcast(encode_step(batch.items, self._step_routes(batch.items)))
        samplers, logits = self.execute(batch.items, on_layer)
        if not samplers:
            return [], None
        assert logits is not None       # rows sampled: the last stage computed their logits
        return samplers, sample(logits, samplers)

    def read_kv(self, blocks: list[int], start: int, end: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(layer_start, head_start, K, V) pieces covering every layer and KV head once."""
        lay = self.layout
        self._broadcast(encode_read_kv(blocks, start, end))
        pieces, seen = [], set()
        heads = self.pool.k[0].shape[1]
        dim = self.pool.k[0].shape[2]
        for rank in range(lay.world):
            stage, tp_rank = divmod(rank, lay.tp)
            layers = lay.stage_layers(stage)
            if rank == 0:
                k, v = self.local_kv(blocks, start, end)
            else:
                k = torch.empty(len(layers), end - start, heads, dim, dtype=self.pool.dtype)
                v = torch.empty(len(layers), end - start, heads, self.pool.v[0].shape[2], dtype=self.pool.dtype)
                dist.recv(k, src=rank)
                dist.recv(v, src=rank)
            head0 = kv_head_start(tp_rank, lay.tp, self.total_kv_heads)
            if (layers.start, head0) not in seen:     # replicated KV heads are sent once
                seen.add((layers.start, head0))
                pieces.append((layers.start, head0, k, v))
        return pieces

    def rank_stats(self) -> list[dict]:
        """Parameter bytes, peak memory and compute time of every rank."""
        self._broadcast(encode_stats())
        vectors = [self.stats_vector()]
        for rank in range(1, self.layout.world):
            v = torch.empty(5, dtype=torch.long)
            dist.recv(v, src=rank)
            vectors.append(v)
        out = []
        for v in vectors:
            rank, params, rss, busy_us, steps = v.tolist()
            stage, tp_rank = divmod(rank, self.layout.tp)
            layers = self.layout.stage_layers(stage)
            out.append({"rank": rank, "stage": stage, "tp_rank": tp_rank, "layers": [layers.start, layers.stop],
                        "parameter_bytes": params, "peak_rss_bytes": rss, "compute_seconds": busy_us / 1e6,
                        "steps": steps})
        return out

    def shutdown(self) -> None:
        self._broadcast(encode_stop())


class RankDirectServer(Protocol):
    """What a worker rank's KV stream server (core/direct_server.py) offers the step loop."""

    def apply(self, routes: StepRoutes) -> None: ...

    def on_layer(self, layer: int, items: list[tuple[Sequence, int]]) -> None: ...


def worker_loop(runner: StageRunner, streams: RankDirectServer | None = None) -> None:
    """A non-driver rank: follow the driver's plans until STOP (or the driver disappears). `streams` (a
    core.direct_server.DirectServer) sends this rank's KV of routed requests as each layer is computed."""
    while True:
        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, 0)
        plan = torch.empty(int(size.item()), dtype=torch.long)
        dist.broadcast(plan, 0)
        kind, payload = decode_plan(plan)
        if kind == STOP:
            return
        if kind == STEP:
            items, routes = cast(StepPayload, payload)
            if streams is not None:
                streams.apply(routes)
            runner.execute(items, streams.on_layer if streams is not None else None)
        elif kind == READ_KV:
            k, v = runner.local_kv(*cast(ReadKVPayload, payload))
            dist.send(k.contiguous(), dst=0)
            dist.send(v.contiguous(), dst=0)
        elif kind == STATS:
            dist.send(runner.stats_vector(), dst=0)
