"""What this node's prefix cache holds, told to the edges connected to it (CacheDigest, capability "prefix-digest").

Used by a core (core/server.py: its edges route prefills by it) and by an edge that serves its peers KV
(edge/peer_server.py: they pull cached blocks by it). Each session's frames go through its outbox, anything with
`put(message, urgent=True)` and `holds_urgent(message)` (core/outbox.py `Outbox`, edge/peer_server.py).

Life cycle: `CacheDigests` starts with the node's server and runs until it stops. Every `interval` seconds it
takes the block hashes the engine's prefix cache gained and lost since its previous look (`changes`: the block
manager's journal, handed over on the engine thread; never a scan of the pool) and applies them to `mirror`, its
copy of the whole set. Then each edge session that listed "prefix-digest" is sent what changed for it, with the
prompt tokens its engine still has to compute (`queued`; the disk tier, if the core has one, is not announced): a session's first digest is the whole mirror (`reset`), later ones the
changes since. Frames go through the session's outbox as urgent items (ahead of KV, each at most
DIGEST_MAX_HASHES hashes, 32 KiB), so a fresh digest does not wait behind a long transfer.

Bounds (an edge that stops reading must not grow the core): while any digest frame of a session is still queued,
nothing more is queued for it; its changes are merged into `pending` (the latest state per hash), and a pending set
larger than the mirror is replaced by one reset. So a session holds at most one digest's frames and a dict no larger
than twice the cache.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgecore.protocol import messages as m
from edgecore.protocol.transport import Peer
from edgecore.shared.errors import EngineDead

log = logging.getLogger("edgecore.core")

INTERVAL = 0.5        # seconds between looks at the cache


def _pack(hashes: list[int]) -> bytes:
    return np.asarray(hashes, dtype="<u8").tobytes()


def frames(block_size: int, stored: list[int], evicted: list[int], reset: bool, queued: int) -> list[m.CacheDigest]:
    """One digest as frames of at most DIGEST_MAX_HASHES hashes each (one frame when nothing changed); only the
    first carries `reset`."""
    out: list[m.CacheDigest] = []
    cap = m.DIGEST_MAX_HASHES
    while True:
        take_s = stored[:cap]
        take_e = evicted[:cap - len(take_s)]
        stored, evicted = stored[len(take_s):], evicted[len(take_e):]
        out.append(m.CacheDigest(block_size, _pack(take_s), _pack(take_e), reset and not out, queued))
        if not stored and not evicted:
            return out


class Outbox(Protocol):
    """What a session's sender offers the digests: urgent messages queued ahead of bulk KV."""
    def put(self, item: m.CacheDigest, *, urgent: bool = ...) -> None: ...

    def holds_urgent(self, item: m.CacheDigest) -> bool: ...


@dataclass(eq=False)
class _Edge:
    """One session's digest state."""
    outbox: Outbox
    announced: bool = False                    # its reset was queued
    pending: dict[int, bool] = field(default_factory=dict)
    queued: int = -1                           # the queue it was last told
    last: m.CacheDigest | None = None          # the last frame queued for it


class CacheDigests:
    def __init__(self, changes: Callable[[], Awaitable[dict[int, bool]]], block_size: int,
                 queued: Callable[[], int], sessions: Callable[[], Iterable[tuple[Peer, Outbox]]],
                 interval: float = INTERVAL) -> None:
        """`changes`: the engine's journal of cache hashes; `queued`: prompt tokens still to prefill here;
        `sessions`: the edge connections now (each peer with its outbox)."""
        self.changes, self.block_size, self.queued, self.sessions = changes, block_size, queued, sessions
        self.interval = interval
        self.mirror: set[int] = set()
        self.edges: dict[Peer, _Edge] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.tick()
            except EngineDead:       # the core is failing: its edges fail over; nothing more to tell
                return
            except Exception:        # a hint only: never take the core down; the next look starts from the journal
                log.exception("prefix digest failed")

    async def tick(self) -> None:
        changes = {h: s for h, s in (await self.changes()).items() if s != (h in self.mirror)}
        for h, cached in changes.items():
            (self.mirror.add if cached else self.mirror.discard)(h)
        queued = self.queued()
        live = {peer: outbox for peer, outbox in self.sessions() if m.PREFIX_DIGEST in peer.conn.peer_capabilities}
        self.edges = {peer: self.edges.get(peer) or _Edge(outbox) for peer, outbox in live.items()}
        for edge in self.edges.values():
            self._tell(edge, changes, queued)

    def _tell(self, edge: _Edge, changes: dict[int, bool], queued: int) -> None:
        if edge.announced:
            edge.pending.update(changes)
            if len(edge.pending) > max(len(self.mirror), m.DIGEST_MAX_HASHES):
                edge.announced, edge.pending = False, {}       # cheaper as the whole set again
        if edge.last is not None and edge.outbox.holds_urgent(edge.last):
            return                                             # it has not taken the previous one yet
        if not edge.announced:
            out = frames(self.block_size, list(self.mirror), [], True, queued)
        elif edge.pending or queued != edge.queued:
            out = frames(self.block_size, [h for h, s in edge.pending.items() if s],
                         [h for h, s in edge.pending.items() if not s], False, queued)
        else:
            return
        for frame in out:
            edge.outbox.put(frame, urgent=True)
        edge.announced, edge.pending, edge.queued, edge.last = True, {}, queued, out[-1]
