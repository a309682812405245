"""A connection's outbox: what its sender sends, in order, with a bound on the KV it holds.

Life cycle: one `Outbox` per edge connection (core/prefill_service.py `Session`; a worker rank's stream
connection, core/direct_server.py), made on the event loop. Producers `put` items: `KVSend`s (one request's
KV) and protocol messages. `urgent=True` (a decode handover's PrefillDone, Token and DecodeStop, and request
refusals) puts an item ahead of every ordinary item queued, in order among the urgent ones, so a token never
waits behind megabytes of KV. The outbox never cuts an item: a caller that wants small KV frames (a handover's
request, `Transfer.piece_bytes`) cuts the slice with `pieces` first. The connection's sender (`send_queued`,
core/kv_sender.py) takes items with `get`; `close` (the sender is gone) wakes everyone who waits.

The bound: `nbytes` counts the raw K/V bytes of the KVSends queued (a message counts nothing). The engine
thread's layer hook asks `reserve(n)` before it copies a layer out of the pool: False when the outbox is over
its `bound` or closed (then it does not copy: back-pressure reaches the hook, see core/kv_sender.py), True after counting
`n`, which the hook's `put(item, reserved=True)` later brings to the loop; so slices on their way between the
threads are counted too. Producers on the loop (`queue_rest`, reading KV back from the pool) wait for
`drained()` — `nbytes` at or below half the bound — before each window they add, and reserve the window while
they read it (`unreserve` after), so producers woken together do not all add one. A slice is allowed into an
empty outbox whatever its size, so a transfer always moves. `drop(transfer)` forgets a cancelled transfer's
queued KV at once.

Threads: everything runs on the event loop except `reserve` (the engine thread); `nbytes` is changed under a
lock by both.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterable

from edgecore.core.transfer import KVSend, Outgoing, Transfer
from edgecore.shared.kv.transfer import KVSlice


def _size(item: Outgoing) -> int:
    return item.piece.k.nbytes + item.piece.v.nbytes if isinstance(item, KVSend) else 0


class Outbox:
    def __init__(self, bound: int | None = None) -> None:
        """`bound`: raw KV bytes queued beyond which the layer hook stops copying (None: no bound)."""
        self.bound = bound
        self.nbytes = 0
        self.closed = False
        self._urgent: deque[Outgoing] = deque()
        self._ordinary: deque[Outgoing] = deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()        # something to take
        self._room = asyncio.Event()         # at or below the low-water mark
        self._urgent_in = asyncio.Event()    # an urgent item was put (wakes the sender's pacing wait)
        self._room.set()

    @property
    def low_water(self) -> int:
        """Where a loop-side producer may add again: half the bound."""
        return (self.bound or 0) // 2

    def __len__(self) -> int:
        return len(self._urgent) + len(self._ordinary)

    def empty(self) -> bool:
        return not self._urgent and not self._ordinary

    # ---- engine thread ------------------------------------------------------------------------
    def reserve(self, n: int, force: bool = False) -> bool:
        """Count `n` more bytes if they fit under the bound (or the outbox holds none, or `force`); False, and
        nothing counted, when they do not. The one method called from the engine thread."""
        with self._lock:
            if self.closed:              # nobody will send it: copy nothing more
                return False
            if not force and self.bound is not None and self.nbytes and self.nbytes + n > self.bound:
                return False
            self.nbytes += n
            return True

    # ---- event loop ---------------------------------------------------------------------------
    def unreserve(self, n: int) -> None:
        """Give back `n` bytes counted by `reserve` whose items were never put."""
        self._uncount(n)

    def put(self, item: Outgoing, *, urgent: bool = False, reserved: bool = False) -> None:
        """Queue `item`: behind every item queued, or (`urgent`) behind the urgent ones only. `reserved`: its
        bytes were counted by `reserve` already. Nothing is kept once the outbox is closed."""
        if self.closed:
            return
        if not reserved and isinstance(item, KVSend):
            self.reserve(_size(item), force=True)
        (self._urgent if urgent else self._ordinary).append(item)
        if urgent:
            self._urgent_in.set()
        self._ready.set()
        self._update_room()

    def extend(self, items: Iterable[Outgoing], *, reserved: bool = False) -> None:
        for item in items:
            self.put(item, reserved=reserved)

    async def get(self) -> Outgoing:
        """The next item: the oldest urgent one, else the oldest ordinary one (waits while there is none)."""
        while self.empty():
            self._ready.clear()
            await self._ready.wait()
        return self.get_nowait()

    def holds_urgent(self, item: Outgoing) -> bool:
        """`item` (this very object), put as urgent, is still queued (the urgent queue is short: the KV is not
        scanned)."""
        return any(i is item for i in self._urgent)

    def has_urgent(self) -> bool:
        return bool(self._urgent)

    def take_urgent(self) -> Outgoing | None:
        """The oldest urgent item, or None: the sender asks between two KV frames, so a token never waits
        behind more than the frame being written."""
        return self._urgent.popleft() if self._urgent else None

    async def wait_urgent(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, less if an urgent item is put meanwhile (the sender's pacing wait)."""
        if not self._urgent and not self.closed:
            await _sleep(self._urgent_in, timeout)

    async def wait_ready(self, timeout: float | None) -> None:
        """Sleep up to `timeout` seconds (None: no limit), less if anything is put meanwhile (the sender's reports
        while idle)."""
        if self.empty() and not self.closed:
            await _sleep(self._ready, timeout)

    def get_nowait(self) -> Outgoing:
        if self.empty():
            raise asyncio.QueueEmpty
        item = self._urgent.popleft() if self._urgent else self._ordinary.popleft()
        self._uncount(_size(item))
        return item

    async def drained(self, items: int | None = None) -> None:
        """Wait until the KV queued is at or below the low-water mark (given `items`: instead, until no more
        than that many items are queued), or the outbox is closed."""
        while not self.closed and (len(self) > items if items is not None else
                                   self.bound is not None and self.nbytes > self.low_water):
            self._room.clear()
            await self._room.wait()

    def drop(self, transfer: Transfer) -> None:
        """Forget the KV queued for `transfer` (cancelled: it would be dropped when taken anyway)."""
        kept = deque(i for i in self._ordinary if not (isinstance(i, KVSend) and i.transfer is transfer))
        freed = sum(_size(i) for i in self._ordinary) - sum(_size(i) for i in kept)
        self._ordinary = kept
        self._uncount(freed)

    def close(self) -> None:
        """The sender is gone: nothing more will be taken; wake whoever waits for room."""
        self.closed = True
        self._urgent.clear()
        self._ordinary.clear()
        with self._lock:
            self.nbytes = 0
        self._room.set()
        self._urgent_in.set()
        self._ready.set()

    def _uncount(self, n: int) -> None:
        if n:
            with self._lock:
                self.nbytes -= n
        self._update_room()

    def _update_room(self) -> None:
        self._room.set()         # waiters check their own condition again (`drained`)


async def _sleep(event: asyncio.Event, timeout: float | None) -> None:
    """Wait for `event` (cleared first) for up to `timeout` seconds (None: no limit); its waiters recheck their own
    condition."""
    event.clear()
    if timeout is None:
        await event.wait()
        return
    timer = asyncio.get_running_loop().call_later(timeout, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()


def pieces(item: KVSend, piece_bytes: int) -> list[KVSend]:
    """A slice cut by token ranges into frames of about `piece_bytes` (0: the slice whole): a token queued
    behind it waits for one piece on the wire, not a whole layer."""
    p = item.piece
    per_token = max(1, (p.k[:, :1].nbytes + p.v[:, :1].nbytes))
    step = max(1, piece_bytes // per_token)
    if not piece_bytes or p.token_end - p.token_start <= step:
        return [item]
    return [KVSend(item.transfer, KVSlice(p.layer, a, min(a + step, p.token_end), p.head_start,
                                          p.k[:, a - p.token_start:a - p.token_start + step],
                                          p.v[:, a - p.token_start:a - p.token_start + step]))
            for a in range(p.token_start, p.token_end, step)]
