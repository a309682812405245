"""The edge engine: decides where each prompt is prefilled, receives KV, decodes.

Life cycle of a request (`generate`, an async iterator of outputs; or `submit`,
which hands each output to a callback from the engine's dispatch, as the
engine process does to forward them without a task switch per token):
1. Placement: prefill locally when no core is healthy, when the prompt is
   short (below `local_prefill_below`, a measured crossover), or when the edge's
   own prefix cache leaves only a short uncached suffix, or when the request
   follows a grammar (the mask must choose every token, the first included,
   so it never asks a core to sample or decode); otherwise pick the core with
   the least predicted time to first token for this prompt (edge/core_choice.py:
   RTT, its prefill queue, and the prompt tokens its prefix cache does not hold,
   from its digests); with `local_prefill_below` auto, the edge's own prediction
   (its uncached suffix behind its own prefill queue) competes too. The choice
   and its predictions go to the log (logger edgecore.placement) and metrics.
2. Remote (`RemotePrefill`, edge/remote_prefill.py, around the sans-IO
   `KVReceiver`, protocol/kv_receiver.py): reserve blocks for the prompt (the
   locally cached prefix is announced as `skip_tokens`), send a PrefillRequest
   with the codec chosen (fixed or adaptive), write arriving KV into the paged
   cache while later layers are still in flight, then `activate` with the
   core's first token: the request joins the decode batch. Ack frees the
   core's copy. With decode handover (a version-3 core; `handover_tokens`) the
   core's first token, and the tokens it decodes while the KV travels, reach
   the caller at once; the edge takes over when the KV is complete.
3. Any failure before the KV is complete (core died, Error, timeout, bad
   chunk): free the reservation, Cancel at the core, retry on another core,
   and finally prefill locally — the caller always gets a full answer.
4. A caller that stops iterating (client disconnect), a cancelled `submit`,
   or `cancel` for a submitted request aborts the request on the edge (and
   at the core while its KV is still in transit). Per-request metrics (TTFT,
   ITL, end-to-end) are kept by `Progress` (edge/progress.py).
The engine is reached only through its `EngineHandle`; this class is the
in-process `EdgeService` that the HTTP frontend (or the engine process) uses.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from collections.abc import AsyncIterator, Callable

from edgecore.edge.codec_policy import CURVE, choose_codec, with_layer0
from edgecore.edge.config import EdgeConfig
from edgecore.edge.core_choice import CoreChoice, Prediction
from edgecore.edge.core_client import CoreClient, CoreRouter
from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.peer_pull import PeerPull
from edgecore.edge.peer_server import PeerServer
from edgecore.edge.placement import PrefillModel
from edgecore.edge.progress import Progress
from edgecore.edge.prefill_plan import RemotePrefillSettings
from edgecore.edge.remote_prefill import RemotePrefill, RemotePrefillFailed
from edgecore.edge.request_trace import RequestTrace
from edgecore.edge.transfer_metrics import TransferMetrics
from prometheus_client import generate_latest
from edgecore.protocol.messages import LORA_ADAPTERS
from edgecore.shared.engine.engine_thread import EngineThread
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.handle import Emit, EngineRequest, Output, OutputQueue, OutputSink, read_outputs
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import EngineDead
from edgecore.shared.models.fingerprint import model_fingerprint
from edgecore.shared.kv.block_manager import NoFreeBlocks
from edgecore.shared.kv.transfer import layers_at_edge
from edgecore.shared.kv.wire import codec_rope
from edgecore.shared.models.lora import scope_salt

log = logging.getLogger("edgecore.edge")
placement_log = logging.getLogger("edgecore.placement")     # one line per request prefilled at a core

PINNED_SHARE = 0.25     # of the KV pool that prefetched contexts may keep pinned


class EdgeNode:
    def __init__(self, config: EdgeConfig, engine: LLMEngine | None = None):
        self.config = config
        engine = engine or LLMEngine.from_dir(config.model_dir, config.dtype, config.device,
                                              config.cache, config.engine)
        engine.lora.max_rank = config.max_lora_rank
        for name, path in config.loras:         # before the engine thread runs (AdapterError: no start)
            engine.lora.load(name, path)
        self.adapters = engine.lora.fingerprints()     # LoRA adapters served (shared/models/lora.py)
        self.handle = EngineThread(engine, threads=config.engine_threads)   # all this node knows of the engine
        self.on_death: Callable[[], None] | None = None   # the engine thread failed (the CLI exits: a supervisor
        self.handle.on_failure = lambda exc: self.on_death and self.on_death()   # restarts the node)
        self.tokenizer = self.handle.tokenizer
        self.metrics = EdgeMetrics(config.served_model_name or Path(config.model_dir).name, self.handle.stats,
                                   self.handle.block_size)
        remote = bool(config.cores or config.core_dns or config.peers or config.peer_listen)
        self.fingerprint = model_fingerprint(config.model_dir, self.handle.config) if remote else ""
        wire_codecs = sorted(set(config.codecs) | {"lossless", "raw"})

        def client(host: str, port: int, server_role: str = "core") -> CoreClient:
            assert config.secret is not None or config.identity is not None, "links need a secret or credential"
            return CoreClient(host, port, secret=config.secret or b"", fingerprint=self.fingerprint,
                              codecs=wire_codecs, timeouts=config.timeouts, ssl=config.ssl, name=config.name,
                              identity=config.identity, trust=config.trust, server_role=server_role)
        self.router = CoreRouter([client(h, p) for h, p in config.cores], dns=config.core_dns, make_client=client)
        self.decoder_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edgecore-decode")
        self.codec_rope = codec_rope(self.handle.config)     # what a core's encoder gives the codecs too
        self.kv_bytes_per_token = self.handle.kv_bytes_per_token
        self.active = 0
        self.pinned: list[list[int]] = []      # prefetched contexts' blocks, least recently prefetched first
        self.prefill_model = PrefillModel(config.local_prefill_below or 32)
        self.peer_pull = PeerPull([client(h, p, "edge") for h, p in config.peers], self.handle, self.prefill_model,
                                  self.metrics, self.decoder_pool, self.codec_rope, config.transfer_timeout)
        self.peer_server = None if config.peer_listen is None else PeerServer(
            self.handle, self.metrics, self.decoder_pool, fingerprint=self.fingerprint, codecs=wire_codecs,
            rope=self.codec_rope, secret=config.secret or b"", identity=config.identity, trust=config.trust,
            timeouts=config.timeouts, name=config.name)
        self.prompt_tokens_mean: float | None = None   # recent prompts' length (EWMA), for the predicted TTFT
        self.metrics.predicted_ttft.set_function(lambda: self.predicted_ttft() or 0.0)   # read at scrape time
        self._started: dict[str, Progress] = {}   # requests begun with `submit`, until they finish
        self._follows: dict[str, asyncio.Task] = {}   # decode handovers still receiving, by request id
        self.handover_counts: dict = {}              # RemotePrefill's tallies (stats)

    async def start(self) -> None:
        self.handle.start()
        self.handle.on_outputs = self._observe
        await self.handle.started()
        if self.router.clients or self.router.dns:
            await self.router.start()
        if self.peer_server is not None:
            assert self.config.peer_listen is not None
            await self.peer_server.start(*self.config.peer_listen)
        await self.peer_pull.start()

    async def stop(self) -> None:
        await self.router.stop()
        await self.peer_pull.stop()
        if self.peer_server is not None:
            await self.peer_server.stop()
        self.handle.stop()
        self.decoder_pool.shutdown(wait=False)

    @property
    def ready(self) -> bool:
        return self.handle.alive

    def _observe(self, outputs: list[RequestOutput]) -> None:
        self.metrics.generation_tokens.inc(sum(len(o.new_token_ids) for o in outputs))

    # ---- placement ---------------------------------------------------------
    async def _placement(self, request: EngineRequest, sink: OutputSink) -> tuple[str, str, bool, CoreChoice | None]:
        """Where the prompt is prefilled: (where, reason, whether the request was already admitted here, the cores'
        predictions when they were made). With
        a fixed threshold, one engine call both measures the cached prefix and, when the rest is short, admits
        the request right there: one step sooner to the first token than deciding first and adding after."""
        params, prompt_ids, needs = request.params, _ids(request), _needs(request)
        if not self.router.healthy(needs):          # an adapter goes only to a core that serves adapters
            reason = "no_lora_core" if needs and self.router.healthy() else "no_core"
            return "local", reason if self.router.clients else "no_core_configured", False, None
        if params.prompt_logprobs is not None:    # they come from this engine's prefill logits
            return "local", "prompt_logprobs", False, None
        if params.guided is not None:     # a core would choose the first token without the grammar's mask
            return "local", "guided", False, None
        threshold = self.config.local_prefill_below
        if threshold == 0:                # never here: no engine turn to measure the cached prefix
            return "remote", "", False, None
        if threshold is None:             # the measured crossover: decided here, on the event loop
            cached = await self.handle.cached_prefix(prompt_ids, request.cache_salt, request.adapter)
            uncached, choice = len(prompt_ids) - cached, self._choice(request)
            best, queue = choice.best(), self.handle.stats().prefill_tokens_left
            if best is not None and self.prefill_model.local_is_faster(uncached, best.address, best.seconds, queue):
                return "local", "faster_here" if cached == 0 else "prefix_cached", False, choice
            return "remote", "", False, choice
        cached, admitted = await self.handle.submit_if_uncached_below(request, sink, threshold)
        if not admitted:
            return "remote", "", False, None
        return "local", "short" if cached == 0 else "prefix_cached", True, None

    def _choice(self, request: EngineRequest) -> CoreChoice:
        """The healthy cores that can take `request`, each with its predicted time to first token for it (its
        prefix cache scoped as the core scopes it: the cache salt, under an adapter its name and fingerprint)."""
        salt = request.cache_salt
        if request.adapter:
            salt = scope_salt(salt, request.adapter, self.adapters.get(request.adapter, ""))
        return CoreChoice(self.router.healthy(_needs(request)), _ids(request), salt, self.prefill_model,
                          digests=self.config.core_routing != "rtt")

    def _codec(self, client: CoreClient, num_tokens: int) -> str:
        assert client.peer is not None          # a picked core is connected
        allowed = [c for c in self.config.codecs if c in client.peer.conn.peer_codecs] or ["lossless"]
        if not self.config.adaptive:
            return allowed[0]
        target = self.config.ttft_target_ms / 1000 if self.config.ttft_target_ms else None
        curve = self.config.kv_curve or CURVE
        if not layers_at_edge(self.handle.layer0_macs_per_token, num_tokens, self.config.layer0_budget_macs, False):
            curve = with_layer0(curve, self.handle.config.num_hidden_layers)     # layer 0 travels
        return choose_codec(allowed, num_tokens * self.kv_bytes_per_token, client.bandwidth, target,
                            self.config.kv_quality_budget, curve)

    # ---- the request -------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, group: str | None = None,
                       cache_salt: str | None = None, *, tenant: str | None = None, weight: float = 1.0,
                       priority: int = 0, adapter: str | None = None, traceparent: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        request = EngineRequest(request_id, prompt_ids, params, group=group, priority=priority, cache_salt=cache_salt,
                                tenant=tenant, weight=weight, adapter=adapter, traceparent=traceparent)
        progress = Progress(self, len(prompt_ids), request_id, traceparent)
        queue: OutputQueue = asyncio.Queue()
        try:
            progress.core = await self._open(request, OutputSink.queue(queue), progress)
            async for out in read_outputs(queue, lambda: self.handle.abort(request_id)):
                progress.observe(out)
                yield out
        finally:
            self._stop_follow(request_id)
            progress.done()

    def _stop_follow(self, request_id: str) -> None:
        """The consumer left: a handover still receiving sends Cancel at once."""
        task = self._follows.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def submit(self, request: EngineRequest, emit: Emit) -> None:
        """`generate` for a forwarder (the engine process): place and start the request, then hand each
        output to `emit` straight from the engine's dispatch, with no task switch per token. `emit` gets
        EngineDead if the engine fails. Cancelling this coroutine undoes it; `cancel(request_id)` aborts
        the request once submitted."""
        rid = request.request_id
        progress = Progress(self, len(_ids(request)), rid, request.traceparent)
        early: list[Output] | None = []     # outputs before the placement returns: observed once it has

        def deliver(item: Output) -> None:
            if not isinstance(item, EngineDead):
                progress.observe(item)
            if isinstance(item, EngineDead) or item.finished:
                self._started.pop(rid, None)
                progress.done()
            emit(item)

        def sink(item: Output) -> None:
            if early is not None:
                early.append(item)
            else:
                deliver(item)
        self._started[rid] = progress
        try:
            progress.core = await self._open(request, OutputSink(sink), progress)
        except BaseException:
            self._started.pop(rid, None)
            self._stop_follow(rid)
            progress.done()
            raise
        held: list[Output] = early or []
        early = None
        for item in held:
            deliver(item)

    def cancel(self, request_id: str) -> None:
        """Abort a request begun with `submit` (its consumer went away); a no-op for any other id."""
        progress = self._started.pop(request_id, None)
        if progress is not None:
            self._stop_follow(request_id)
            progress.done()
            self.handle.abort(request_id)

    def cancel_all(self) -> None:
        """Abort every request begun with `submit` and not finished (the forwarder went away)."""
        for request_id in list(self._started):
            self.cancel(request_id)

    async def _open(self, request: EngineRequest, sink: OutputSink, progress: Progress) -> CoreClient | None:
        """Place the prefill and start the request (in its fairness group, its prefix cache scoped by its
        `cache_salt`, here and at the core), its outputs going to `sink`; returns the core that prefilled it, or
        None."""
        n, mean = len(_ids(request)), self.prompt_tokens_mean
        self.prompt_tokens_mean = n if mean is None else 0.9 * mean + 0.1 * n
        progress.queued = self.handle.stats().prefill_tokens_left     # ahead of it here (a core's: `_chosen`)
        pulled = await self.peer_pull.pulled(request, self._choice)     # a peer edge's cached prefix, now here
        where, reason, admitted, choice = (("local", "peer_pull", False, None) if pulled
                                           else await self._placement(request, sink))
        progress.placed_at = time.perf_counter()
        self.metrics.queue_time.observe(progress.placed_at - progress.arrived)
        trace = progress.trace
        if trace is not None:
            trace.placed(where, reason, progress.placed_at)
        core = None
        if where == "remote":
            core, reason = await self._remote_with_retries(request, sink, progress, choice or self._choice(request))
            admitted = core is not None
        if core is None:                  # placed here, or every core failed
            self.metrics.local_prefills.labels(reason).inc()
            if trace is not None:
                trace.local(reason)
        if not admitted:
            await self.handle.submit(request, sink)
        return core

    async def _remote_with_retries(self, request: EngineRequest, sink: OutputSink, progress: Progress,
                                   choice: CoreChoice) -> tuple[CoreClient | None, str]:
        """Prefill at a core, then decode here: (the core, ""); (None, why) when nothing was admitted: every core
        tried failed ("core_failed"), or this edge's KV pool has no room for the prompt now ("kv_full": the request
        then waits in this engine's queue, prefilled here once blocks free up, instead of failing). The cores are
        tried best predicted first. Traced, each attempt is a span whose traceparent the core gets."""
        tried: set[str] = set()
        trace = progress.trace
        for attempt in range(self.config.max_core_attempts):
            pick = choice.best(tried)
            if pick is None:
                break
            client = pick.client
            tried.add(client.address)
            traced = request if trace is None else replace(request, traceparent=trace.attempt(client.address))
            self._chosen(request, pick, choice, progress)
            try:
                await self._remote(client, traced, sink, trace)
                self.metrics.prefill_predicted.observe(pick.seconds)     # (the attempt that took it, once)
                self.metrics.core_cached_tokens.inc(pick.cached)
                progress.measured = attempt == 0       # after a failed attempt its time is not this core's rate
                return client, ""
            except NoFreeBlocks:        # reserving the prompt's blocks here: nothing was sent to the core
                client.cache.prefill_sent(-pick.uncached)
                progress.measured = False       # its wait for blocks is not this edge's prefill rate
                if trace is not None:
                    trace.attempt_failed("no free KV blocks at the edge")
                log.info("request %s: no free KV blocks for its %d prompt tokens; it waits here for a local prefill",
                         request.request_id, len(_ids(request)))
                return None, "kv_full"
            except RemotePrefillFailed as exc:
                if trace is not None:
                    trace.attempt_failed(str(exc))
                log.warning("request %s: core %s failed (%s); %s", request.request_id, client.address, exc,
                            "retrying" if attempt + 1 < self.config.max_core_attempts else "prefilling locally")
                self.metrics.failovers.inc()
        progress.measured = False               # its time includes the failed attempts
        return None, "core_failed"

    def _chosen(self, request: EngineRequest, pick: Prediction, choice: CoreChoice, progress: Progress) -> None:
        """A core is asked to prefill: its queue grows by the tokens it computes; the prediction is logged and,
        from this attempt's start, measured (the request's first token tells how good it was)."""
        choice.sent(pick)
        progress.predicted = (pick.seconds, time.perf_counter())
        progress.queued = pick.queue
        placement_log.info("request %s: prefill at core %s, predicted TTFT %.3f s (%d of %d prompt tokens cached "
                           "there); %s", request.request_id, pick.address, pick.seconds, pick.cached,
                           pick.cached + pick.uncached, choice.describe())
        if progress.trace is not None:
            progress.trace.predicted(pick.address, pick.seconds, pick.cached)

    async def prefetch(self, prompt_ids: list[int]) -> dict:
        """Bring a context's KV to this edge ahead of requests (from a core if one is healthy, else by
        prefilling locally) and pin it in the prefix cache; later prompts starting with it only prefill
        the rest."""
        request = EngineRequest(f"prefetch-{uuid.uuid4().hex}", prompt_ids, SamplingParams(max_tokens=1,
                                                                                           temperature=0))
        source, pick = "local", self._choice(request).best()     # the core that holds most of it, if any
        for client in [pick.client] if pick is not None else []:
            try:
                await self._remote(client, request, None)
                source = client.address
            except (RemotePrefillFailed, NoFreeBlocks) as exc:
                log.warning("prefetch from %s failed (%s); prefilling locally", client.address,
                            str(exc) or "no free KV blocks")
        if source == "local":
            async for _ in self.handle.generate(replace(request, prefill_only=True)):
                pass
        blocks = await self.handle.commit_prefix(request.request_id)
        await self._keep_pinned(blocks)
        return {"tokens": len(prompt_ids), "cached_tokens": len(blocks) * self.handle.block_size,
                "source": source}

    async def _keep_pinned(self, blocks: list[int]) -> None:
        """Pinned contexts hold at most `PINNED_SHARE` of the KV pool: the same context again is one pin,
        refreshed; beyond the share the least recently prefetched ones are unpinned (they stay in the prefix
        cache, evictable like any cached block). Without the bound any client could fill the pool for good."""
        for i, old in enumerate(self.pinned):
            if old == blocks:
                del self.pinned[i]
                await self.handle.unpin(old)
                break
        self.pinned.append(blocks)
        limit = int(self.handle.stats().blocks_total * PINNED_SHARE)
        while self.pinned and len(set().union(*self.pinned)) > limit:     # one larger than the share: cached only
            await self.handle.unpin(self.pinned.pop(0))
            self.metrics.contexts_unpinned.inc()

    async def _remote(self, client: CoreClient, request: EngineRequest, sink: OutputSink | None,
                      trace: RequestTrace | None = None) -> None:
        """Prefill at `client` and receive the KV; with a `sink`, the request then decodes here, its outputs
        going to `sink` (None: a prefetch, never activated)."""
        settings = RemotePrefillSettings(self.config.transfer_timeout, self.config.handover_tokens, self.codec_rope,
                                         self.config.layer0_budget_macs)
        prefill = RemotePrefill(self.handle, client, request, settings=settings, pool=self.decoder_pool,
                                metrics=TransferMetrics(self.metrics, self.handover_counts, trace),
                                adapter_fingerprint=self.adapters.get(request.adapter or "", ""))
        await prefill.run(self._codec, sink)
        rid = request.request_id
        if prefill.follow is not None:
            self._follows[rid] = prefill.follow
            prefill.follow.add_done_callback(lambda t: self._follows.pop(rid, None) if
                                             self._follows.get(rid) is t else None)

    # ---- EdgeService (edge/service.py; across the process boundary: edge/node_client.py) ------------
    async def load_adapter(self, name: str, path: str) -> str:
        """Load a LoRA adapter into the engine (AdapterError: nothing loaded); its fingerprint."""
        fingerprint = await self.handle.load_adapter(name, path)
        self.adapters[name] = fingerprint
        return fingerprint

    async def unload_adapter(self, name: str) -> None:
        await self.handle.unload_adapter(name)
        self.adapters.pop(name, None)

    @property
    def max_model_len(self) -> int:
        return self.handle.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.handle.config.vocab_size

    async def get_stats(self) -> dict:
        return self.stats()

    async def get_metrics(self) -> str:
        """The Prometheus exposition of this edge's metrics, gauges refreshed from the engine."""
        stats = self.handle.stats()
        m = self.metrics
        m.running.set(stats.running)
        m.waiting.set(stats.waiting)
        m.kv_usage.set(stats.kv_cache_usage)
        return generate_latest(m.registry).decode()

    def predicted_ttft(self) -> float | None:
        """The TTFT a new request of the recent mean prompt length would see now (`PrefillModel.predict_ttft`
        behind the requests waiting here); None before any prompt or measured prefill."""
        if self.prompt_tokens_mean is None:
            return None
        cores = [(c.address, c.rtt) for c in self.router.healthy()]
        return self.prefill_model.predict_ttft(self.prompt_tokens_mean, self.handle.stats().waiting, cores)

    async def get_readiness(self) -> dict:
        # Local prefill is always a prefill path once the engine runs.
        return {"ready": self.ready, "cores_healthy": len(self.router.healthy())}

    def count_error(self, status: str) -> None:
        self.metrics.errors.labels(status).inc()

    def stats(self) -> dict:
        stats = self.handle.stats().as_dict()
        pm = self.prefill_model
        stats.update({
            "requests": self.active,
            "handover": {**self.handover_counts, "receiving": len(self._follows)},
            "prefill_model": {"local_ms_per_token": round(pm.local_per_token * 1e3, 4) if pm.local_per_token else None,
                              "crossover_tokens": {c.address: pm.crossover(c.address, c.rtt)
                                                   for c in self.router.clients}},
            "cores": [{"address": c.address, "healthy": c.healthy, "rtt_ms": round(c.rtt * 1e3, 2),
                       "load": c.load, "stream_connections": len(c.direct_peers),
                       "bandwidth_MBps": _megabytes_per_s(c.bandwidth),
                       "last_transfer_MBps": _megabytes_per_s(c.last_bandwidth),
                       "prefix_digest": {"blocks": len(c.cache.hashes), "block_size": c.cache.block_size,
                                         "queued_tokens": c.cache.queue} if c.cache.known else None,
                       "error": c.last_error} for c in self.router.clients],
            "peers": [{"address": c.address, "healthy": c.healthy, "rtt_ms": round(c.rtt * 1e3, 2),
                       "announced_blocks": len(c.cache.hashes), "bandwidth_MBps": _megabytes_per_s(c.bandwidth)}
                      for c in self.peer_pull.router.clients],
            "peer_sessions": len(self.peer_server.sessions) if self.peer_server is not None else None,
        })
        return stats


def _ids(request: EngineRequest) -> list[int]:
    """An edge request's prompt: token ids (the frontend tokenizes)."""
    assert isinstance(request.prompt, list), "an edge request's prompt is token ids"
    return request.prompt


def _needs(request: EngineRequest) -> str | None:
    """The core capability a request needs: "lora" for one with an adapter (an older core would drop it)."""
    return LORA_ADAPTERS if request.adapter else None


def _megabytes_per_s(rate: float | None) -> float | None:
    return round(rate / 1e6, 1) if rate else None
