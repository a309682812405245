"""The edge engine: decides where each prompt is prefilled, receives KV, decodes.

Life cycle of a request (`generate`, an async iterator of outputs; or `submit`,
which hands each output to a callback from the engine's dispatch, as the
engine process does to forward them without a task switch per token):
1. Placement: prefill locally when no core is healthy, when the prompt is
   short (below `local_prefill_below`, a measured crossover), or when the edge's
   own prefix cache leaves only a short uncached suffix; otherwise pick a core
   by RTT and load.
2. Remote: reserve blocks for the prompt (the locally cached prefix is reused
   and announced as `skip_tokens`), send a PrefillRequest with the codec
   chosen (fixed or adaptive), decode arriving KVChunks in a worker thread
   (checksum first) and write them into the paged cache while later layers
   are still in flight, check every layer and token arrived, then `activate`
   with the core's first token: the request joins the decode batch. Ack
   frees the core's copy.
3. Any failure before the KV is complete (core died, Error, timeout, bad
   chunk): free the reservation, Cancel at the core, retry on another core,
   and finally prefill locally — the caller always gets a full answer.
4. A caller that stops iterating (client disconnect), a cancelled `submit`,
   or `cancel` for a submitted request aborts the request on the edge (and
   at the core while its KV is still in transit). Per-request metrics (TTFT,
   ITL, end-to-end) are kept by `_Progress`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from edgecore.edge.codec_policy import choose_codec
from edgecore.edge.core_client import CoreClient, CoreRouter
from edgecore.edge.metrics import EdgeMetrics
from edgecore.edge.placement import PrefillModel
from prometheus_client import generate_latest
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ProtocolError
from edgecore.protocol.kv import SMALL_CHUNK_BYTES, decode_chunk
from edgecore.protocol.state import KVData
from edgecore.protocol.transport import PeerError, Timeouts
from edgecore.shared.config import CacheConfig, EngineConfig
from edgecore.shared.engine.async_engine import AsyncEngine
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.fingerprint import model_fingerprint
from edgecore.shared.kv.wire import from_bits

log = logging.getLogger("edgecore.edge")


@dataclass
class EdgeConfig:
    model_dir: str
    cores: list[tuple[str, int]] = field(default_factory=list)
    core_dns: list[tuple[str, int]] = field(default_factory=list)   # names resolved to cores (headless Service)
    secret: bytes | None = None
    dtype: str = "auto"
    device: str = "cpu"
    codecs: list[str] = field(default_factory=lambda: ["lossless"])   # allowed; lossy only if listed
    adaptive: bool = False
    ttft_target_ms: float | None = None
    local_prefill_below: int | None = 32   # None: measured crossover (fixed 32 until measured)
    transfer_timeout: float = 30.0
    max_core_attempts: int = 2
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_threads: int | None = None   # intra-op threads of the engine thread (None: leave as they are)
    timeouts: Timeouts = field(default_factory=Timeouts)
    name: str = "edge"
    ssl: object = None


class RemotePrefillFailed(Exception):
    pass


class EdgeEngine:
    def __init__(self, config: EdgeConfig, engine: LLMEngine | None = None):
        self.config = config
        self.engine = engine or LLMEngine.from_dir(config.model_dir, config.dtype, config.device,
                                                   config.cache, config.engine)
        self.tokenizer = self.engine.tokenizer
        self.metrics = EdgeMetrics()
        self.aengine = AsyncEngine(self.engine, threads=config.engine_threads)
        remote = bool(config.cores or config.core_dns)
        self.fingerprint = model_fingerprint(config.model_dir, self.engine.config) if remote else ""
        wire_codecs = sorted(set(config.codecs) | {"lossless", "raw"})

        def client(host: str, port: int) -> CoreClient:
            return CoreClient(host, port, secret=config.secret, fingerprint=self.fingerprint, codecs=wire_codecs,
                              timeouts=config.timeouts, ssl=config.ssl, name=config.name)
        self.router = CoreRouter([client(h, p) for h, p in config.cores], dns=config.core_dns, make_client=client)
        self.decoder_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edgecore-decode")
        self.kv_bytes_per_token = self.engine.config.kv_bytes_per_token(self.engine.pool.k[0].element_size())
        self.active = 0
        self.pinned: list[list[int]] = []      # prefetched contexts' blocks
        self.prefill_model = PrefillModel(config.local_prefill_below or 32)
        self._started: dict[str, _Progress] = {}   # requests begun with `submit`, until they finish

    async def start(self) -> None:
        self.aengine.start()
        self.aengine.on_outputs = self._observe
        if self.router.clients or self.router.dns:
            await self.router.start()

    async def stop(self) -> None:
        await self.router.stop()
        self.aengine.stop()
        self.decoder_pool.shutdown(wait=False)

    @property
    def ready(self) -> bool:
        return self.aengine.alive

    def _observe(self, outputs: list[RequestOutput]) -> None:
        self.metrics.generation_tokens.inc(sum(len(o.new_token_ids) for o in outputs))

    # ---- placement ---------------------------------------------------------
    async def _placement(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                         ) -> tuple[str, str, asyncio.Queue | None]:
        """Where the prompt is prefilled: (where, reason, the output queue if the request was already added
        here). With a fixed threshold, one engine call both measures the cached prefix and, when the rest
        is short, adds the request right there: one step sooner to the first token than deciding first
        and adding after."""
        if not self.router.healthy():
            return "local", "no_core" if self.router.clients else "no_core_configured", None
        if params.prompt_logprobs is not None:    # they come from this engine's prefill logits
            return "local", "prompt_logprobs", None
        threshold = self.config.local_prefill_below
        if threshold is None:             # the measured crossover: decided here, on the event loop
            cached = await self.aengine.call(lambda e: len(e.block_manager.match_prefix(prompt_ids))
                                             * e.block_manager.block_size)
            uncached = len(prompt_ids) - cached
            best = self.router.pick()
            if best is not None and self.prefill_model.local_is_faster(uncached, best.address, best.rtt):
                return "local", "faster_here" if cached == 0 else "prefix_cached", None
            return "remote", "", None

        def place(e) -> str | None:       # on the engine thread
            cached = len(e.block_manager.match_prefix(prompt_ids)) * e.block_manager.block_size
            if len(prompt_ids) - cached >= threshold:
                return None
            e.add_request(request_id, prompt_ids, params)
            return "short" if cached == 0 else "prefix_cached"

        reason, queue = await self.aengine.admit(request_id, place)
        if reason is None:
            self.aengine.close_stream(request_id)
            return "remote", "", None
        return "local", reason, queue

    def _codec(self, client: CoreClient, num_tokens: int) -> str:
        allowed = [c for c in self.config.codecs if c in client.peer.conn.peer_codecs] or ["lossless"]
        if not self.config.adaptive:
            return allowed[0]
        target = self.config.ttft_target_ms / 1000 if self.config.ttft_target_ms else None
        return choose_codec(allowed, num_tokens * self.kv_bytes_per_token, client.bandwidth, target)

    # ---- the request -------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        progress = _Progress(self, len(prompt_ids))
        try:
            queue, progress.core = await self._open(request_id, prompt_ids, params, progress)
            async for out in self.aengine.stream(request_id, queue):
                progress.observe(out)
                yield out
        finally:
            progress.done()
            self.aengine.close_stream(request_id)

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     emit: Callable[[RequestOutput | BaseException], None]) -> None:
        """`generate` for a forwarder (the engine process): place and start the request, then hand each
        output to `emit` straight from the engine's dispatch, with no task switch per token. `emit` gets an
        exception if the engine fails. Cancelling this coroutine undoes it; `cancel(request_id)` aborts
        the request once submitted."""
        progress = _Progress(self, len(prompt_ids))
        try:
            _, progress.core = await self._open(request_id, prompt_ids, params, progress)
        except BaseException:
            progress.done()
            self.aengine.close_stream(request_id)
            raise

        def sink(item: RequestOutput | BaseException) -> None:
            failed = isinstance(item, BaseException)
            if not failed:
                progress.observe(item)
            if failed or item.finished:
                self._started.pop(request_id, None)
                progress.done()
                self.aengine.close_stream(request_id)
            emit(item)

        self._started[request_id] = progress
        self.aengine.redirect(request_id, sink)

    def cancel(self, request_id: str) -> None:
        """Abort a request begun with `submit` (its consumer went away); a no-op for any other id."""
        progress = self._started.pop(request_id, None)
        if progress is not None:
            progress.done()
            self.aengine.close_stream(request_id)
            self.aengine.abort(request_id)

    def cancel_all(self) -> None:
        """Abort every request begun with `submit` and not finished (the forwarder went away)."""
        for request_id in list(self._started):
            self.cancel(request_id)

    async def _open(self, request_id: str, prompt_ids: list[int], params: SamplingParams, progress: "_Progress"):
        """Place the prefill and start the request: (the queue its outputs arrive in; the core that
        prefilled it or None)."""
        where, reason, queue = await self._placement(request_id, prompt_ids, params)
        self.metrics.queue_time.observe(time.perf_counter() - progress.arrived)
        core = None
        if where == "remote":
            queue, core = await self._remote_with_retries(request_id, prompt_ids, params)
            reason = "core_failed"
        if queue is None:
            self.metrics.local_prefills.labels(reason).inc()
            _, queue = await self.aengine.admit(request_id, lambda e: e.add_request(request_id, prompt_ids, params))
        return queue, core

    async def _remote_with_retries(self, request_id, prompt_ids, params):
        tried: set[str] = set()
        for attempt in range(self.config.max_core_attempts):
            client = self.router.pick(tried)
            if client is None:
                break
            tried.add(client.address)
            try:
                return await self._remote(client, request_id, prompt_ids, params), client
            except RemotePrefillFailed as exc:
                log.warning("request %s: core %s failed (%s); %s", request_id, client.address, exc,
                            "retrying" if attempt + 1 < self.config.max_core_attempts else "prefilling locally")
                self.metrics.failovers.inc()
        return None, None

    async def prefetch(self, prompt_ids: list[int]) -> dict:
        """Bring a context's KV to this edge ahead of requests (from a core if one is healthy, else by
        prefilling locally) and pin it in the prefix cache; later prompts starting with it only prefill
        the rest."""
        rid = f"prefetch-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0)
        source = "local"
        for client in [c for c in [self.router.pick()] if c is not None]:
            try:
                await self._remote(client, rid, prompt_ids, params, activate=False)
                source = client.address
            except RemotePrefillFailed as exc:
                log.warning("prefetch from %s failed (%s); prefilling locally", client.address, exc)
        if source == "local":
            async for _ in self.aengine.generate(rid, prompt_ids, params, prefill_only=True):
                pass
        blocks = await self.aengine.call(lambda e: e.commit_prefix(rid))
        self.pinned.append(blocks)
        return {"tokens": len(prompt_ids), "cached_tokens": len(blocks) * self.engine.block_manager.block_size,
                "source": source}

    async def _remote(self, client: CoreClient, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      activate: bool = True) -> asyncio.Queue | None:
        """Prefill at `client` and receive the KV; with `activate`, the request then decodes here and this
        returns the queue its outputs arrive in."""
        engine_cfg = self.engine.config
        seq, cached = await self.aengine.call(lambda e: e.reserve(request_id, prompt_ids, params))
        queue = self.aengine.open_stream(request_id)
        codec = self._codec(client, len(prompt_ids) - cached)
        spec = m.SamplingSpec(**params.spec_fields())
        want = len(prompt_ids) - cached
        got = [0] * engine_cfg.num_hidden_layers
        heads = engine_cfg.num_key_value_heads
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        encoded = raw = 0
        first_chunk_at = last_chunk_at = None
        first_chunk_bytes = 0
        ok = False
        direct = client.direct
        try:
            events = await client.prefill(m.PrefillRequest(request_id, prompt_ids, spec, [codec],
                                                           int(self.config.transfer_timeout * 1000), cached,
                                                           direct=direct))
            done: m.PrefillDone | None = None    # a parallel core's other ranks may still be sending after it
            while done is None or any(n < want * heads for n in got):
                ev = await asyncio.wait_for(events.get(), self.config.transfer_timeout)
                if isinstance(ev, KVData):
                    c = ev.chunk
                    if (c.token_start < cached or c.token_end > len(prompt_ids) or c.layer_end > len(got)
                            or c.head_start < 0 or c.head_end > heads):
                        raise RemotePrefillFailed(f"chunk outside the request: {c}")
                    # A small chunk costs less to decode here than to hand to a thread and back.
                    k, v = decode_chunk(ev) if ev.chunk.raw_len < SMALL_CHUNK_BYTES else \
                        await loop.run_in_executor(self.decoder_pool, decode_chunk, ev)
                    kt, vt = from_bits(k, c.dtype), from_bits(v, c.dtype)
                    for i, layer in enumerate(range(c.layer_start, c.layer_end)):
                        self.aengine.post(lambda e, l=layer, s=c.token_start, kk=kt[i], vv=vt[i], h=c.head_start:
                                          e.write_kv(request_id, l, s, kk, vv, h))
                        got[layer] += (c.token_end - c.token_start) * (c.head_end - c.head_start)
                        if got[layer] > want * heads:
                            raise RemotePrefillFailed(f"layer {layer} received more KV than the request has")
                    encoded += len(ev.payload)
                    raw += c.raw_len
                    last_chunk_at = time.perf_counter()
                    if first_chunk_at is None:
                        first_chunk_at, first_chunk_bytes = last_chunk_at, len(ev.payload)
                elif isinstance(ev, m.PrefillDone):
                    done = ev
                    if not direct and any(n != want * heads for n in got):   # one sender: all KV came first
                        raise RemotePrefillFailed(f"incomplete KV: token×heads per layer {got}, expected "
                                                  f"{want * heads}")
                elif isinstance(ev, m.Error):
                    raise RemotePrefillFailed(f"core error {ev.code}: {ev.message}")
                elif isinstance(ev, BaseException):
                    raise RemotePrefillFailed(str(ev))
            top = [tuple(t) for t in done.top_logprobs]
            if activate:
                await self.aengine.call(lambda e: e.activate(
                    request_id, done.first_token, done.logprob if params.logprobs is not None else None, top))
            ok = True
            await client.send(m.Ack(request_id))
        except (asyncio.TimeoutError, PeerError, ProtocolError) as exc:
            raise RemotePrefillFailed(str(exc) or type(exc).__name__) from None
        finally:
            # Link estimate: the bytes that arrived after the first chunk, over the span they took.
            span = (last_chunk_at - first_chunk_at) if first_chunk_at is not None else 0.0
            client.finish(request_id, encoded - first_chunk_bytes, span)
            if not ok:
                self.aengine.close_stream(request_id)
                self.aengine.post(lambda e: e.release(request_id))
                await client.send(m.Cancel(request_id))
        self.metrics.remote_prefills.labels(codec).inc()
        self.metrics.kv_bytes.labels(codec).inc(encoded)
        self.metrics.kv_raw_bytes.labels(codec).inc(raw)
        if encoded:
            self.metrics.compression.labels(codec).set(raw / encoded)
        self.metrics.transfer.labels(codec).observe(time.perf_counter() - started)
        if not activate:
            self.aengine.close_stream(request_id)
            return None
        return queue

    # ---- what EdgeHTTP uses (the same surface as edge/engine_client.EngineClient) -----------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    async def get_stats(self) -> dict:
        return self.stats()

    async def get_metrics(self) -> str:
        """The Prometheus exposition of this edge's metrics, gauges refreshed from the engine."""
        stats = self.engine.stats()
        m = self.metrics
        m.running.set(stats["running"])
        m.waiting.set(stats["waiting"])
        m.kv_usage.set(stats["kv_cache_usage"])
        return generate_latest(m.registry).decode()

    async def get_readiness(self) -> dict:
        # Local prefill is always a prefill path once the engine runs.
        return {"ready": self.ready, "cores_healthy": len(self.router.healthy())}

    def count_error(self, status: str) -> None:
        self.metrics.errors.labels(status).inc()

    def stats(self) -> dict:
        stats = self.engine.stats()
        pm = self.prefill_model
        stats.update({
            "requests": self.active,
            "prefill_model": {"local_ms_per_token": round(pm.local_per_token * 1e3, 4) if pm.local_per_token else None,
                              "crossover_tokens": {c.address: pm.crossover(c.address, c.rtt)
                                                   for c in self.router.clients}},
            "cores": [{"address": c.address, "healthy": c.healthy, "rtt_ms": round(c.rtt * 1e3, 2),
                       "load": c.load, "stream_connections": len(c.streams),
                       "bandwidth_MBps": _megabytes_per_s(c.bandwidth),
                       "last_transfer_MBps": _megabytes_per_s(c.last_bandwidth),
                       "error": c.last_error} for c in self.router.clients],
        })
        return stats


def _megabytes_per_s(rate: float | None) -> float | None:
    return round(rate / 1e6, 1) if rate else None


class _Progress:
    """One request's counters and latency metrics, fed each output (by `generate` or `submit`'s sink)."""

    def __init__(self, edge: EdgeEngine, prompt_len: int):
        self.edge, self.prompt_len = edge, prompt_len
        self.arrived = time.perf_counter()
        self.core: CoreClient | None = None
        self.first_at = self.last_at = None
        self.open = True
        edge.active += 1
        edge.metrics.prompt_tokens.inc(prompt_len)

    def observe(self, out: RequestOutput) -> None:
        metrics, now = self.edge.metrics, time.perf_counter()
        if self.first_at is None:
            self.first_at = now
            metrics.ttft.observe(now - self.arrived)
            metrics.cached_tokens.inc(out.num_cached_tokens)
            prefilled = self.prompt_len - out.num_cached_tokens
            if self.core is None:
                self.edge.prefill_model.observe_local(prefilled, now - self.arrived)
            else:
                self.edge.prefill_model.observe_remote(self.core.address, prefilled, now - self.arrived,
                                                       self.core.rtt)
        elif out.new_token_ids:
            metrics.itl.observe(now - self.last_at)
        self.last_at = now
        if out.finished:
            metrics.requests.labels(out.finish_reason).inc()
            metrics.e2e.observe(now - self.arrived)

    def done(self) -> None:
        if self.open:
            self.open = False
            self.edge.active -= 1
