"""The core node: accepts edges over the KV protocol and prefills for them.

Life cycle of one edge connection (a `Session`): handshake (transport) →
loop over incoming messages: PrefillRequest starts `_prefill` (a task),
Cancel aborts, Ack releases the KV → on disconnect every request of the
session is aborted and its blocks freed.

Life cycle of one remote request: validated → registered with the
`LayerStreamer` → added to the engine as prefill-only (it is batched with
other prefills under the step token budget, chunked if long, and reuses the
core's prefix cache) → each layer's K/V leaves as soon as it is computed →
PrefillDone with the first token → KV held under a lease until the edge's Ack
(or Cancel, or the lease expiring) frees it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from edgecore.core.kv_sender import LayerStreamer, RemoteRequest, send_queued
from edgecore.core.metrics import CoreMetrics
from edgecore.protocol import messages as m
from edgecore.protocol.codecs import CODECS
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.transport import Peer, PeerError, Timeouts, serve
from edgecore.shared.config import CacheConfig, EngineConfig
from edgecore.shared.engine.async_engine import AsyncEngine
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from edgecore.shared.fingerprint import model_fingerprint
from edgecore.shared.kv.wire import DTYPE_NAMES

log = logging.getLogger("edgecore.core")


@dataclass
class CoreConfig:
    model_dir: str
    secret: bytes
    host: str = "127.0.0.1"
    port: int = 7100
    http_host: str = "127.0.0.1"
    http_port: int | None = 7101
    dtype: str = "auto"
    device: str = "cpu"
    lease_seconds: float = 30.0
    codecs: list[str] = field(default_factory=lambda: list(CODECS))
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    name: str = "core"
    ssl: object = None
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
    gather_kv: bool = False             # parallel core: rank 0 sends all KV, the other ranks serve no streams
    control: object = None              # core/http.py ControlPort: server limits, push targets (None: defaults)
    rendezvous: str = "127.0.0.1:0"     # parallel core: HOST:PORT of the ranks' TCP store (port 0: any free)


class Session:
    _ids = itertools.count(1)

    def __init__(self, peer: Peer):
        self.id = next(self._ids)
        self.peer = peer
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: dict[str, RemoteRequest] = {}


class CoreServer:
    def __init__(self, config: CoreConfig, engine: LLMEngine | None = None):
        self.config = config
        self.workers = []
        self.stream_ports: list[int] = []   # worker ranks' KV stream servers (parallel core)
        self.parallel = config.tp * config.pp > 1
        self.failure: str | None = None
        if engine is None and self.parallel:
            from edgecore.core.ranks import start_parallel_engine
            engine, self.workers, self.stream_ports = start_parallel_engine(
                config.model_dir, config.tp, config.pp, config.dtype, config.device, config.cache, config.engine,
                config.pp_split, config.pp_micro_batches, streams=self._stream_config(),
                rendezvous=config.rendezvous)
        self.engine = engine or LLMEngine.from_dir(config.model_dir, config.dtype, config.device,
                                                   config.cache, config.engine)
        self.fingerprint = model_fingerprint(config.model_dir, self.engine.config)
        self.dtype_name = DTYPE_NAMES[self.engine.dtype]
        self.metrics = CoreMetrics()
        self.sessions: set[Session] = set()
        self.encoder_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edgecore-encode")
        self.server = None
        self.http_runner = None
        self.aengine: AsyncEngine | None = None
        self.streamer: LayerStreamer | None = None
        self.started_at = time.time()
        data_dir = Path(config.data_dir) if config.data_dir else Path("edgecore-data") / config.name
        self.data_dir = data_dir
        from edgecore.core.model_server import ModelServer
        self.model_server = ModelServer(config.model_dir, data_dir)
        self.http_extensions = [self.model_server.routes]
        self.store = self.batches = self.contexts = None

    def _stream_config(self):
        """Where and how worker ranks serve their own KV streams (None: they don't; rank 0 gathers)."""
        from edgecore.core.ranks import StreamConfig
        c = self.config
        if c.gather_kv or c.ssl is not None or not c.stream_layers:   # TLS material stays with rank 0
            return None
        return StreamConfig(c.host, c.secret, list(c.codecs))

    @property
    def layout(self) -> dict:
        cfg = self.engine.config
        return {"tp": self.config.tp, "pp": self.config.pp, "num_layers": cfg.num_hidden_layers,
                "num_kv_heads": cfg.num_key_value_heads}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # On a parallel core this streams rank 0's own layers and heads; the other ranks stream theirs.
        self.streamer = LayerStreamer(self.engine.pool, self.engine.model, loop,
                                      "stream" if self.config.stream_layers else "hold")
        self.aengine = AsyncEngine(self.engine, on_layer=self.streamer.on_layer, threads=self.config.engine_threads)
        self.aengine.start()
        c = self.config
        from edgecore.core.batch_api import BatchAPI
        from edgecore.core.batch_runner import BatchRunner
        from edgecore.core.batch_store import BatchStore
        from edgecore.core.contexts import Contexts
        self.store = BatchStore(self.data_dir)
        self.contexts = Contexts(self, self.store)
        await self.contexts.restore()
        self.batches = BatchRunner(self, self.store, model_name(c.model_dir), c.batch_inflight)
        self.batches.start()
        self.http_extensions.append(BatchAPI(self, self.store, self.batches, self.contexts, c.max_file_bytes).routes)
        self.server = await serve(self._session, host=c.host, port=c.port, secret=c.secret,
                                  fingerprint=self.fingerprint, codecs=c.codecs, timeouts=c.timeouts,
                                  ssl=c.ssl, name=c.name, layout=self.layout, load_fn=self.load,
                                  streams=self.stream_ports)
        self.port = self.server.sockets[0].getsockname()[1]
        if self.workers:
            from edgecore.core.ranks import RankWatch
            self.watch = RankWatch(self.workers, lambda why: loop.call_soon_threadsafe(self.mark_failed, why))
            self.watch.start()
        if c.http_port is not None:
            from edgecore.core.http import start_control_port
            self.http_runner, self.http_port = await start_control_port(self, c.http_host, c.http_port)
        log.info("core %s: protocol on %s:%d", c.name, c.host, self.port)

    def mark_failed(self, why: str) -> None:
        """A rank died: stop serving (edges fail over), report unhealthy on /ready and /stats."""
        log.error("core %s is unhealthy: %s", self.config.name, why)
        self.failure = why
        if self.server is not None:
            self.server.close()
        for session in list(self.sessions):
            asyncio.ensure_future(session.peer.fail(f"core failed: {why}", ErrorCode.INTERNAL))

    async def stop(self) -> None:
        if self.workers and self.failure is None and self.aengine is not None and self.aengine.alive:
            await self.aengine.call(lambda e: e.runner.shutdown())
            self.watch.stopped.set()
        if self.workers:
            self.watch.stop_all()
        if self.server is not None:
            self.server.close()
        for session in list(self.sessions):
            await session.peer.close()
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if self.batches is not None:
            await self.batches.stop()
        if self.aengine is not None:
            self.aengine.stop()
        if self.store is not None:
            self.store.close()
        self.encoder_pool.shutdown(wait=False)

    # ---- one edge connection ---------------------------------------------
    async def _session(self, peer: Peer) -> None:
        session = Session(peer)
        self.sessions.add(session)
        self.metrics.connections.inc()
        sender = asyncio.create_task(self._sender(session))
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                msg = await peer.recv()
                if isinstance(msg, m.PrefillRequest):
                    task = asyncio.create_task(self._prefill(session, msg))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif isinstance(msg, m.Ack):
                    self._release(session, msg.request_id)
                elif isinstance(msg, m.Cancel):
                    self._release(session, msg.request_id, cancelled=True)
        except PeerError as exc:
            log.info("edge %s left: %s", peer.peername, exc)
        finally:
            for rid in list(session.requests):
                self._release(session, rid, cancelled=True)
            for task in tasks:
                task.cancel()
            sender.cancel()
            self.sessions.discard(session)
            self.metrics.connections.dec()

    async def _sender(self, session: Session) -> None:
        """Encodes and sends queued KV layers and PrefillDone messages, in order."""
        def counted(req, data):
            self.metrics.kv_chunks.inc()
            self.metrics.kv_bytes_sent.labels(req.codec).inc(len(data.payload))
            self.metrics.kv_raw_bytes.labels(req.codec).inc(data.chunk.raw_len)
        await send_queued(session.queue, session.peer, self.encoder_pool, self.dtype_name, counted)

    async def _prefill(self, session: Session, msg: m.PrefillRequest) -> None:
        peer = session.peer
        rid = msg.request_id
        codec = next((c for c in msg.codecs if c in peer.conn.peer_codecs), None)
        error = None
        if rid in session.requests:
            error = f"request id {rid} is already in flight on this connection"
        elif codec is None:
            error = f"none of the codecs {msg.codecs} is available (negotiated: {peer.conn.peer_codecs})"
        elif not 0 <= msg.skip_tokens < len(msg.token_ids):
            error = f"skip_tokens {msg.skip_tokens} must be below the prompt length {len(msg.token_ids)}"
        if error:
            self.metrics.prefill_requests.labels("rejected").inc()
            await peer.send(m.Error(ErrorCode.BAD_REQUEST if codec else ErrorCode.CODEC, error, rid))
            return
        internal = f"s{session.id}/{rid}"
        token_ids = list(msg.token_ids)
        direct = self.parallel and bool(self.stream_ports) and msg.direct and bool(peer.conn.session)
        req = RemoteRequest(internal, rid, session, codec, len(token_ids), msg.skip_tokens,
                            gather=self.parallel and not direct)
        s = msg.sampling
        try:
            params = SamplingParams(max_tokens=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    seed=s.seed, logprobs=s.logprobs)
        except RequestError as exc:
            await peer.send(m.Error(ErrorCode.BAD_REQUEST, str(exc), rid))
            return
        session.requests[rid] = req
        self.streamer.remote[internal] = req
        if direct:      # the other ranks learn the route with the first step that computes this request
            self.engine.runner.add_route(internal, [rid, peer.conn.session, codec, msg.skip_tokens, len(token_ids)])
        first = None
        try:
            gen = self.aengine.generate(internal, token_ids, params, prefill_only=True)
            deadline = msg.deadline_ms / 1000 if msg.deadline_ms > 0 else None
            async with asyncio.timeout(deadline):
                async for out in gen:
                    if out.finished:
                        first = out
        except RequestError as exc:
            self._forget(session, rid)
            self.metrics.prefill_requests.labels("rejected").inc()
            await peer.send(m.Error(ErrorCode.BAD_REQUEST, str(exc), rid))
            return
        except TimeoutError:
            self._release(session, rid, cancelled=True)
            self.metrics.prefill_requests.labels("timeout").inc()
            await peer.send(m.Error(ErrorCode.TIMEOUT, f"prefill missed its deadline of {msg.deadline_ms} ms", rid))
            return
        if first is None or req.cancelled:
            return
        seq_info = first.logprobs[0] if first.logprobs else None
        timings = {"total_ms": (time.perf_counter() - req.received_at) * 1e3}
        if req.first_chunk_sent_at is not None:
            timings["first_chunk_sent_ms"] = (req.first_chunk_sent_at - req.received_at) * 1e3
        if req.last_layer_at is not None:
            timings["last_layer_done_ms"] = (req.last_layer_at - req.received_at) * 1e3
        done = m.PrefillDone(rid, first.new_token_ids[0], seq_info.logprob if seq_info else 0.0,
                             list(seq_info.top) if seq_info else [], req.total_tokens, first.num_cached_tokens,
                             timings)
        req.done = True
        if req.gather:
            internal = req.internal_id
            pieces = await self.aengine.call(lambda e: e.runner.read_kv(
                e.requests[internal].seq.table.blocks, req.skip_tokens, req.total_tokens))
            for layer0, head0, k, v in pieces:
                req.held.append(("kv", req, layer0, req.skip_tokens, req.total_tokens, k, v, head0))
        for item in req.held:            # baseline mode: all KV after the last layer
            session.queue.put_nowait(item)
        req.held.clear()
        session.queue.put_nowait(("done", done))
        self.metrics.prefill_requests.labels("ok").inc()
        self.metrics.prompt_tokens.inc(req.total_tokens)
        self.metrics.cached_tokens.inc(first.num_cached_tokens)
        self.metrics.prefill_seconds.observe(time.perf_counter() - req.received_at)
        req.lease = asyncio.get_running_loop().call_later(self.config.lease_seconds, self._release, session, rid)
        self.metrics.leases.inc()

    def _forget(self, session: Session, rid: str) -> RemoteRequest | None:
        req = session.requests.pop(rid, None)
        if req is not None:
            self.streamer.remote.pop(req.internal_id, None)
            if self.parallel:
                self.engine.runner.drop_route(req.internal_id)
        return req

    def _release(self, session: Session, rid: str, cancelled: bool = False) -> None:
        """Free a request's KV at the core (Ack, Cancel, lease expiry, disconnect)."""
        req = self._forget(session, rid)
        if req is None:
            return
        req.cancelled = req.cancelled or cancelled
        if req.lease is not None:
            req.lease.cancel()
            self.metrics.leases.dec()
        self.aengine.abort(req.internal_id)

    def load(self) -> int:
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.running)

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats.update({
            "connections": len(self.sessions),
            "remote_requests": sum(len(s.requests) for s in self.sessions),
            "leases": sum(1 for s in self.sessions for r in s.requests.values() if r.lease is not None),
            "engine_alive": bool(self.aengine and self.aengine.alive) and self.failure is None,
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
