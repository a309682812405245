"""An edge serving its peers: the KV of the prefix-cache blocks it holds, to edges that pull them (`--peer-listen`).

Life cycle: `EdgeNode.start` starts a `PeerServer` when the edge has `--peer-listen` (in the engine process, beside
the engine thread). It listens with the protocol server of the cores (same handshake, authentication and sealing;
its AuthOk lists the capability "block-pull"); a connecting edge must present an edge credential, and a pulling
edge checks that this one does too (protocol/state.py `server_role`). Each connection is a `_Session`:
1. `CacheDigests` (shared/node/cache_digest.py, as a core's) tells it what this edge's prefix cache holds and
   its prefill queue, every 0.5 s while that changes, through the session's `_DigestBox`.
2. BlockPull (edge/peer_pull.py asks): a task reads the leading run of the asked blocks the pool still holds
   (`EngineThread.pool_blocks`, a window of PULL_WINDOW_BYTES at a time, copies), encodes each block as one
   KVChunk with the asked codec on the encoder threads, sends them in order (each send waits for the socket,
   so a slow or stalled puller holds one window at most and is dropped after the idle timeout), then
   BlockPullDone with the count. Nothing is computed: a block evicted meanwhile ends the run.
3. Cancel stops that pull; a closed connection stops all of its pulls. A PrefillRequest (an edge whose --core
   names this port) is answered with an Error for that request: it fails over as from a core that refused it.
Bounds: at most MAX_PULLS pulls in flight per connection (one more is answered Error OVERLOADED); a BlockPull
with another block size, more than DIGEST_MAX_HASHES hashes or a codec not negotiated is answered with an Error
naming it, and the connection goes on. Blocks of an MLA pool are not served (the capability is not listed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from edgecore.edge.metrics import EdgeMetrics
from edgecore.protocol import messages as m
from edgecore.protocol.credentials import NodeIdentity, Trust
from edgecore.protocol.errors import ErrorCode
from edgecore.protocol.kv import encode_chunk
from edgecore.protocol.transport import Peer, PeerError, Timeouts, serve
from edgecore.shared.engine.engine_thread import EngineThread
from edgecore.shared.kv.wire import to_bits
from edgecore.shared.node.cache_digest import CacheDigests
from edgecore.shared.node.env import link_sealed

log = logging.getLogger("edgecore.edge")

MAX_PULLS = 4                        # per connection, in flight
PULL_WINDOW_BYTES = 16 << 20         # K/V copied out of the pool per engine call


class _DigestBox:
    """A session's digest frames, sent in order by one task (the `Outbox` CacheDigests asks for)."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.items: deque[m.CacheDigest] = deque()
        self.ready = asyncio.Event()

    def put(self, item: m.CacheDigest, *, urgent: bool = True) -> None:
        self.items.append(item)
        self.ready.set()

    def holds_urgent(self, item: m.CacheDigest) -> bool:
        return any(i is item for i in self.items)

    async def run(self) -> None:
        with contextlib.suppress(PeerError):          # (the connection is gone: its reader ends the session)
            while True:
                await self.ready.wait()
                self.ready.clear()
                while self.items:
                    await self.peer.send(self.items[0])
                    self.items.popleft()


@dataclass(eq=False)
class _Session:
    peer: Peer
    outbox: _DigestBox
    pulls: dict[str, asyncio.Task] = field(default_factory=dict)


class PeerServer:
    def __init__(self, handle: EngineThread, metrics: EdgeMetrics, encoders: Executor, *, fingerprint: str,
                 codecs: list[str], rope: tuple[float, ...] | None, secret: bytes, identity: NodeIdentity | None,
                 trust: Trust | None, timeouts: Timeouts, name: str) -> None:
        self.handle, self.metrics, self.encoders = handle, metrics, encoders
        self.fingerprint, self.codecs, self.rope = fingerprint, codecs, rope
        self.secret, self.identity, self.trust, self.timeouts, self.name = secret, identity, trust, timeouts, name
        self.sessions: list[_Session] = []
        self.digests = CacheDigests(handle.cache_changes, handle.block_size,
                                    lambda: handle.stats().prefill_tokens_left,
                                    lambda: [(s.peer, s.outbox) for s in self.sessions])
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        caps = m.CAPABILITIES if self.handle.block_shape is None else (*m.CAPABILITIES, m.BLOCK_PULL)
        self.server = await serve(self.serve, host=host, port=port, secret=self.secret, fingerprint=self.fingerprint,
                                  codecs=self.codecs, timeouts=self.timeouts, name=self.name, identity=self.identity,
                                  trust=self.trust, sealed=link_sealed(), capabilities=caps)
        self.port = self.server.sockets[0].getsockname()[1]
        self.digests.start()
        log.info("edge %s: serving cached KV to peer edges on %s:%d", self.name, host, self.port)

    async def stop(self) -> None:
        await self.digests.stop()
        if self.server is not None:
            self.server.close()
        for session in list(self.sessions):
            await session.peer.close()

    async def serve(self, peer: Peer) -> None:
        """One peer edge's connection, until it closes."""
        session = _Session(peer, _DigestBox(peer))
        self.sessions.append(session)
        writer = asyncio.create_task(session.outbox.run())
        try:
            while True:
                msg = await peer.recv()
                if isinstance(msg, m.BlockPull):
                    await self._start_pull(session, msg)
                elif isinstance(msg, m.Cancel):
                    task = session.pulls.pop(msg.request_id, None)
                    if task is not None:
                        task.cancel()
                elif isinstance(msg, m.PrefillRequest):       # (an edge's --core pointed here)
                    await peer.send(m.Error(int(ErrorCode.BAD_REQUEST), "this is an edge serving cached KV to its "
                                            "peers: it prefills nothing for them", msg.request_id))
        finally:
            self.sessions.remove(session)
            writer.cancel()
            for task in session.pulls.values():
                task.cancel()

    async def _start_pull(self, session: _Session, msg: m.BlockPull) -> None:
        rid = msg.request_id
        why, code = self._refusal(session, msg), ErrorCode.BAD_REQUEST
        if why is None and len(session.pulls) >= MAX_PULLS:
            why, code = f"more than {MAX_PULLS} pulls in flight on this connection", ErrorCode.OVERLOADED
        if why is not None:
            await session.peer.send(m.Error(int(code), why, rid))
            return
        hashes = np.frombuffer(msg.hashes, "<u8").tolist()
        task = asyncio.create_task(self._pull(session.peer, rid, hashes, msg.codec))
        session.pulls[rid] = task
        task.add_done_callback(lambda _: session.pulls.pop(rid, None) if session.pulls.get(rid) is task else None)

    def _refusal(self, session: _Session, msg: m.BlockPull) -> str | None:
        if msg.request_id in session.pulls:
            return f"pull {msg.request_id} is already in flight"
        if msg.block_size != self.handle.block_size:
            return f"block size {msg.block_size} (this edge's is {self.handle.block_size})"
        if len(msg.hashes) % 8 or len(msg.hashes) > 8 * m.DIGEST_MAX_HASHES:
            return f"hashes must be 8 bytes each, at most {m.DIGEST_MAX_HASHES}"
        if msg.codec not in session.peer.conn.peer_codecs:
            return f"codec {msg.codec!r} was not negotiated"
        return None

    async def _pull(self, peer: Peer, rid: str, hashes: list[int], codec: str) -> None:
        shape = self.handle.block_shape
        assert shape is not None            # (BLOCK_PULL is listed only then)
        loop = asyncio.get_running_loop()
        sent = 0
        try:
            while sent < len(hashes):
                blocks = await self.handle.pool_blocks(hashes[sent:], PULL_WINDOW_BYTES)
                if not blocks:
                    break
                for k, v in blocks:
                    encode = partial(encode_chunk, rid, to_bits(k), to_bits(v), layer_start=0, token_start=0,
                                     dtype=shape.dtype, codec=codec, rope=self.rope)
                    await peer.send(await loop.run_in_executor(self.encoders, encode))
                    sent += 1
                    self.metrics.peer_served_blocks.inc()
            await peer.send(m.BlockPullDone(rid, sent))
        except PeerError:
            return                          # the connection is gone: its reader ends the session
        except Exception as exc:            # the engine failed, a bug: this pull fails, the connection goes on
            log.exception("serving a block pull failed")
            with contextlib.suppress(PeerError):
                await peer.send(m.Error(int(ErrorCode.INTERNAL), f"pull failed: {exc}", rid))
