"""The core node: wires the engine handle, the protocol server, the control port and the batch subsystem.

Life cycle: `CoreServer(config)` loads the model (or starts a parallel core's
ranks, core/ranks.py) and keeps only an `EngineHandle` to it; `start()` starts
the engine thread, the `LayerSender` (its per-layer hook), the
`PrefillService` (core/prefill_service.py: edges' sessions and their KV
transfers) behind the protocol server, the prefix digests those edges route by
(shared/node/cache_digest.py), the batch subsystem (store, contexts,
runner, API routes) and the control port (core/http.py). Each of them receives
the handle, not the node. A rank that dies, or an engine thread that fails, marks
the node failed (`mark_failed`: it stops serving, edges fail over, /health turns
503 so a supervisor restarts it); `stop()` takes everything down in reverse.
`drain(timeout)` (SIGTERM, shared/node/service.py) comes before `stop()`: the protocol port stops listening, /ready
turns 503, edges are told (Draining, protocol version 4) and new prefills refused, and it returns once the
edges' requests in flight have finished; the batch runner keeps running meanwhile (its committed results are
kept; `stop()` leaves the uncommitted ones to run again after the restart).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from ssl import SSLContext
from typing import TYPE_CHECKING

from edgecore.shared.node.cache_digest import CacheDigests
from edgecore.core.kv_sender import LayerSender
from edgecore.core.metrics import CoreMetrics
from edgecore.core.prefill_service import MAX_INFLIGHT, OUTBOX_BYTES, PrefillService
from edgecore.core.transfer import HandoverLimits
from edgecore.protocol.codecs import CODECS
from edgecore.protocol.credentials import NodeIdentity, Trust
from edgecore.protocol.transport import Timeouts, serve
from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.engine.engine_thread import EngineThread
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.models.lora_files import MAX_LORA_RANK
from edgecore.shared.models.fingerprint import model_fingerprint
from edgecore.shared.kv.wire import DTYPE_NAMES, codec_step_scales
from edgecore.shared.node.env import link_sealed

if TYPE_CHECKING:
    from aiohttp import web

    from edgecore.core.batch_runner import BatchRunner
    from edgecore.core.batch_store import BatchStore
    from edgecore.core.contexts import Contexts
    from edgecore.core.http import ControlPort
    from edgecore.core.ranks import DirectConfig

log = logging.getLogger("edgecore.core")


@dataclass
class CoreConfig:
    model_dir: str
    secret: bytes                      # the cluster secret (b"" with per-node credentials only)
    identity: NodeIdentity | None = None   # this core's credential and whom it trusts (per-node credentials)
    trust: Trust | None = None
    host: str = "127.0.0.1"
    port: int = 7100
    http_host: str = "127.0.0.1"
    http_port: int | None = 7101
    dtype: str = "auto"
    device: str = "cpu"
    lease_seconds: float = 30.0
    handover: HandoverLimits = field(default_factory=HandoverLimits)   # decoding for edges before they take over
    codecs: list[str] = field(default_factory=lambda: list(CODECS))
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    name: str = "core"
    ssl: SSLContext | None = None
    data_dir: str | None = None
    stream_layers: bool = True          # False: hold all KV until the prefill ends (baseline mode)
    api_keys: list[bytes] = field(default_factory=list)   # for the HTTP /v1/ routes (batch API)
    max_file_bytes: int = 200 * 1024 * 1024
    batch_inflight: int = 256           # > engine max_num_seqs, so a queue refills the batch at once
    tp: int = 1                         # tensor-parallel ranks
    pp: int = 1                         # pipeline stages
    pp_split: list[int] | None = None   # layers per stage (default: balanced)
    pp_micro_batches: int = 0           # micro-batches per step (default: one per stage)
    engine_threads: int | None = None   # intra-op threads of the engine thread (None: leave as they are)
    external_workers: bool = False      # parallel core: the worker ranks are started elsewhere and join
    gather_kv: bool = False             # parallel core: rank 0 sends all KV, the other ranks serve no streams
    control: ControlPort | None = None  # core/http.py ControlPort: server limits, push targets (None: defaults)
    rendezvous: str = "127.0.0.1:0"     # parallel core: HOST:PORT of the ranks' TCP store (port 0: any free)
    max_inflight: int = MAX_INFLIGHT    # per edge connection: requests in flight (beyond: Error OVERLOADED)
    max_admitted: int | None = None     # per edge connection: requests in the engine at once (None: half its seqs)
    outbox_bytes: int | None = OUTBOX_BYTES   # per edge connection: KV bytes copied and queued for its sender
    loras: list[tuple[str, str]] = field(default_factory=list)     # LoRA adapters served (shared/models/lora.py)
    max_lora_rank: int = MAX_LORA_RANK


class CoreServer:
    def __init__(self, config: CoreConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.workers: list[subprocess.Popen] = []
        self.stream_ports: list[int] = []   # worker ranks' KV stream servers (parallel core)
        self.parallel = config.tp * config.pp > 1
        self.failure: str | None = None
        if engine is None and self.parallel:
            from edgecore.core.ranks import start_parallel_engine
            engine, self.workers, self.stream_ports = start_parallel_engine(
                config.model_dir, config.tp, config.pp, config.dtype, config.device, config.cache, config.engine,
                config.pp_split, config.pp_micro_batches, streams=self._direct_config(),
                rendezvous=config.rendezvous, external=config.external_workers)
        engine = engine or LLMEngine.from_dir(config.model_dir, config.dtype, config.device,
                                              config.cache, config.engine)
        engine.lora.max_rank = config.max_lora_rank
        for name, path in config.loras:      # LoRA adapters edges may ask prefills with (AdapterError: no start)
            engine.lora.load(name, path)
        # On a parallel core this streams rank 0's own layers and heads; the other ranks stream theirs.
        self.streamer = LayerSender(engine.pool, engine.model, None, "stream" if config.stream_layers else "hold")
        self.streamer.step_scales = codec_step_scales(config.model_dir)
        self.handle = EngineThread(engine, on_layer=self.streamer.on_layer, threads=config.engine_threads)
        self.handle.on_failure = lambda exc: self.mark_failed(f"engine failed: {exc}")
        self.fingerprint = model_fingerprint(config.model_dir, self.handle.config)
        self.metrics = CoreMetrics(model_name(config.model_dir), self.handle.stats, self.handle.block_size)
        self.encoder_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edgecore-encode")
        admitted = config.max_admitted or min(config.max_inflight, max(1, config.engine.max_num_seqs // 2))
        self.prefill = PrefillService(self.handle, self.streamer, self.metrics, self.encoder_pool,
                                      DTYPE_NAMES[engine.dtype], config.lease_seconds, self.parallel,
                                      self.parallel and bool(self.stream_ports), config.handover,
                                      config.max_inflight, admitted, config.outbox_bytes)
        self.prefill.adapters = engine.lora.fingerprints()
        self.metrics.prefill_backlog.set_function(self.prefill.backlog_tokens)     # read at scrape time
        # the queue edges are told: prompt tokens the engine has still to compute, whoever asked (edges, the batch
        # API), cached prefixes of admitted requests excluded, as the edges count what they send
        self.digests = CacheDigests(self.handle.cache_changes, self.handle.block_size,
                                    lambda: self.handle.stats().prefill_tokens_left,
                                    lambda: [(s.peer, s.outbox) for s in self.prefill.sessions])
        self.metrics.draining.set_function(lambda: float(self.draining))
        self.server: asyncio.Server | None = None
        self.http_runner: web.AppRunner | None = None
        self.started = False
        self.draining = False
        self.started_at = time.time()
        data_dir = Path(config.data_dir) if config.data_dir else Path("edgecore-data") / config.name
        self.data_dir = data_dir
        from edgecore.core.model_server import ModelServer
        self.model_server = ModelServer(config.model_dir, data_dir)
        self.http_extensions = [self.model_server.routes]
        self.store: BatchStore | None = None
        self.batches: BatchRunner | None = None
        self.contexts: Contexts | None = None

    def _direct_config(self) -> DirectConfig | None:
        """Where and how worker ranks serve their own KV streams (None: they don't; rank 0 gathers)."""
        from edgecore.core.ranks import DirectConfig
        c = self.config
        if c.gather_kv or c.external_workers or c.ssl is not None or not c.stream_layers:   # TLS material stays with rank 0
            return None
        return DirectConfig(c.host, c.secret, list(c.codecs))

    @property
    def layout(self) -> dict:
        cfg = self.handle.config
        return {"tp": self.config.tp, "pp": self.config.pp, "num_layers": cfg.num_hidden_layers,
                "num_kv_heads": cfg.num_key_value_heads}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.streamer.loop = loop
        self.handle.start()
        await self.handle.started()
        self.started = True
        c = self.config
        await self._start_batches()
        self.server = await serve(self.prefill.serve, host=c.host, port=c.port, secret=c.secret,
                                  fingerprint=self.fingerprint, codecs=c.codecs, timeouts=c.timeouts,
                                  ssl=c.ssl, name=c.name, layout=self.layout, load_fn=self.load,
                                  streams=self.stream_ports, identity=c.identity, trust=c.trust,
                                  sealed=link_sealed())
        self.port = self.server.sockets[0].getsockname()[1]
        self.digests.start()
        if self.failure is not None:     # failed while starting: the port opens closed
            self.server.close()
        if self.workers:
            from edgecore.core.ranks import RankWatch
            self.watch = RankWatch(self.workers, lambda why: loop.call_soon_threadsafe(self.mark_failed, why))
            self.watch.start()
        if c.http_port is not None:
            from edgecore.core.http import start_control_port
            self.http_runner, self.http_port = await start_control_port(self, c.http_host, c.http_port)
        log.info("core %s: protocol on %s:%d", c.name, c.host, self.port)

    async def _start_batches(self) -> None:
        """The batch subsystem: store, contexts (restored), runner, and their routes on the control port."""
        from edgecore.core.batch_api import BatchAPI
        from edgecore.core.batch_runner import BatchRunner
        from edgecore.core.batch_store import BatchStore
        from edgecore.core.contexts import Contexts
        c = self.config
        self.store = BatchStore(self.data_dir)
        self.contexts = Contexts(self.handle, self.store, self.config.control)
        await self.contexts.restore()
        self.batches = BatchRunner(self.handle, self.store, model_name(c.model_dir), c.batch_inflight,
                                   self.metrics, self.parallel)
        self.batches.start()
        self.http_extensions.append(BatchAPI(self.handle, self.store, self.batches, self.contexts,
                                             c.max_file_bytes).routes)

    def mark_failed(self, why: str) -> None:
        """A rank died or the engine thread failed: stop serving (edges fail over), report unhealthy on /health,
        /ready and /stats."""
        if self.failure is not None:     # the first cause stays (a dead rank, then the engine thread it stops)
            log.error("core %s: also %s", self.config.name, why)
            return
        log.error("core %s is unhealthy: %s", self.config.name, why)
        self.failure = why
        if self.server is not None:
            self.server.close()
        self._failing = asyncio.ensure_future(self.prefill.fail_all(f"core failed: {why}"))   # held

    async def drain(self, timeout: float) -> None:
        """Graceful stop, before `stop()`: no new edges or prefills; returns once the requests in flight have
        finished (the caller bounds it by `timeout`, which edges are told)."""
        self.draining = True
        if self.server is not None:
            self.server.close()
        inflight = self.prefill.inflight()
        log.info("core %s draining: %d request(s) in flight, at most %g s", self.config.name, inflight, timeout)
        self.prefill.start_drain(timeout)
        await self.prefill.drained()

    async def stop(self) -> None:
        if self.workers and self.failure is None and self.started and self.handle.alive:
            await self.handle.shutdown_ranks()
            self.watch.stopped.set()
        if self.workers:
            self.watch.stop_all()
        if self.server is not None:
            self.server.close()
        await self.digests.stop()
        await self.prefill.close()
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if self.batches is not None:
            await self.batches.stop()
        if self.started:
            self.handle.stop()
        if self.store is not None:
            self.store.close()
        self.encoder_pool.shutdown(wait=False)

    @property
    def alive(self) -> bool:
        """The engine runs and no rank failed."""
        return self.started and self.handle.alive and self.failure is None

    def load(self) -> int:
        return self.handle.stats().load

    def stats(self) -> dict:
        stats = self.handle.stats().as_dict()
        stats.update(self.prefill.stats())
        stats.update({
            "engine_alive": self.alive,
            "failure": self.failure,
            "model_fingerprint": self.fingerprint,
            "contexts": len(self.contexts.pinned) if self.contexts else 0,
            "layout": self.layout,
        })
        return stats


def model_name(model_dir: str) -> str:
    """The model id in API requests and responses: the model directory's name (or the packed original's)."""
    from edgecore.shared.pack import is_packed
    if is_packed(model_dir):
        import json
        return json.loads((Path(model_dir) / "edgecore-pack.json").read_text()).get("name", Path(model_dir).name)
    return Path(model_dir).resolve().name
