"""A KV-carrying connection's pacing: KV leaves at the rate the edge receives it, so nothing queues on the path
in front of a latency-critical frame (docs/wire-format.md §5a, "Latency-critical frames").

Life cycle: `bound_write_path` (core/prefill_service.py) gives each version-3 connection one `Pacer`. The
connection's sender (`send_queued`, core/kv_sender.py) asks `Pacer.wait` before every KV frame (urgent items
queued meanwhile go first) and tells `Pacer.sent` after it. While KV waits to go, the pacer pings the edge every
`REPORT_SECONDS`; the edge answers each Ping with a Pong carrying what its kernel has received on this connection
and when, in its own clock (`Pong.received`, `Pong.at_us`). `LinkModel.report` turns each answer into:

- the link's delivery rate: bytes received over the edge's clock between two readings at least `SAMPLE_SECONDS`
  apart (the edge's stalls do not distort it: a reading is the kernel's count at the moment it is taken), the
  largest of the last `SAMPLES` (`bw`);
- the bytes queued on the path: what this side had written one forward trip before the reading, less what the
  edge had received (`queue`). The forward trip is found without synchronised clocks: the least (Pong arrival -
  reading time) is the return trip plus the clocks' offset, the least ping round trip is both trips.

From that the pacer keeps a model of the bottleneck's clock (`free_at`: when it will have carried every byte
written), re-anchored at every report from the measured queue and replayed over the writes since, and writes the
next frame only once the modelled queue ahead is under `HEADROOM`. While reports show no queue the model runs at
`PROBE_GAIN` times the measured rate, so a rate measured too low grows until the path queues; once it queues, at
the measured rate. A connection's first KV, before any sample, often is one burst (a layer's KV) and then
nothing: the sender keeps pinging while it drains (`Pacer.idle`), and a Ping that waited behind it gives a first
estimate of the rate (`LinkModel.first`), so the next burst, the one a first token may follow, is paced already.
Before any KV, a connection starts with a probe train of padded Pings (`Pacer._probe`) whose reports give that
first estimate on a slow link before the first request.
Until then, and for an edge that sends no reports (an older version), KV is only bounded: frames cut, and a new
one written only while this side's unsent bytes (`Peer.unsent`) are under two frames. `LinkModel` does no I/O:
tests drive it with a scripted link.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgecore.protocol import messages as m
from edgecore.protocol.transport import Peer

if TYPE_CHECKING:
    from edgecore.core.outbox import Outbox

PIECE_SECONDS = 0.004             # a paced KV frame lasts about this long on the link
# Frames are cut only as small as the link needs (each chunk carries its own codec parameters, so smaller frames
# cost bytes): 4 ms of a fast link is a large frame; before a measurement, a handover piece's size.
PIECE_MIN, PIECE_MAX = 16 * 1024, 1024 * 1024
UNPACED_PIECE = 128 * 1024        # before the link's rate is known (as a handover request's pieces are cut)
HEADROOM = 0.004                  # a new frame is written once the modelled queue ahead is shorter than this
PROBE_GAIN = 1.15                 # the model's rate over the measured one while the path shows no queue
QUEUED_SECONDS = 0.002            # a report's queue longer than this: the link sets the pace
REPORT_SECONDS = 0.01             # while KV waits to go, a Ping (its Pong is a report) this often
SAMPLE_SECONDS = 0.1              # a delivery sample spans at least this much of the edge's clock
FIRST_SECONDS = 0.03              # before the first sample, a queued Ping's wait this long gives a first rate
FIRST_SLACK = 0.002               # ... from a reading up to this much before the wait began (the Ping written then)
PROBE_TRAIN = 8                   # a connection's start: this many Pings back to back, each padded with
PROBE_PAD = 32 * 1024             # ... this many bytes (a first rate on links up to ~60 Mbit/s: the train lasts >= 30 ms)
PROBE_WAIT = 1.0                  # seconds the first Pong may take; later, the train is not sent
IDLE_REPORTS = 0.5                # while no rate is known, reports go on this long after the last KV frame
SAMPLES = 64                      # the rate is the largest of this many recent samples
WRITE_LOG = 4096                  # writes remembered (to look up what had been written at a report's time)


@dataclass
class LinkModel:
    """What the edge's reports say about the path (sans-IO; times in this side's monotonic seconds unless named
    edge_*). `writes`: (time, bytes written so far) after each write on the connection, oldest first."""
    writes: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=WRITE_LOG))
    rtt_min: float = math.inf         # least ping round trip
    clock: float = math.inf           # least (Pong arrival - the edge's reading time): return trip + clock offset
    offset: int | None = None         # bytes written here - bytes received there, at the least (see `report`)
    bw: float | None = None           # delivery rate, bytes/s
    queue: int = 0                    # bytes queued on the path at the last report
    queued: bool = False              # the last report found a queue: the link sets the pace
    free_at: float = 0.0              # when the modelled bottleneck has carried every byte written
    reports: int = 0
    reported_at: float = -math.inf    # when the last report arrived
    ever_queued: bool = False         # some report found a queue
    idle_at: float = -math.inf        # when this side last had no KV to send (a span since is not the link's)
    _readings: deque[tuple[float, int, bool, float]] = field(default_factory=deque)  # (edge time, received, queued, here)
    _samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))

    @property
    def sampled(self) -> bool:
        """The rate comes from a full delivery sample (not none, nor a first estimate)."""
        return bool(self._samples)

    @property
    def first(self) -> bool:
        """`bw` is a first estimate (`_first_estimate`): the first sample replaces it, higher or lower."""
        return self.bw is not None and not self._samples

    def rate(self, now: float) -> float | None:
        """The model's rate: the measured one, times `PROBE_GAIN` while the path shows no queue and the reports are
        fresh (an edge whose answers are late gets no probe it could not stop)."""
        if self.bw is None:
            return None
        fresh = now - self.reported_at <= self.rtt_min + 2 * REPORT_SECONDS
        return self.bw if self.queued or not fresh else self.bw * PROBE_GAIN

    def delay(self, now: float) -> float:
        """Seconds until the next KV frame may be written: until the modelled queue ahead is under `HEADROOM` (0
        while the rate is unknown: only the unsent bytes bound the writes then)."""
        if self.bw is None:
            return 0.0
        return max(0.0, self.free_at - now - HEADROOM)

    def wrote(self, now: float, nbytes: int) -> None:
        """A KV frame of `nbytes` was written at `now` (the log itself is the connection's, `writes`)."""
        rate = self.rate(now)
        if rate is not None:
            self.free_at = max(self.free_at, now) + nbytes / rate

    def _since(self, t: float) -> tuple[int, list[tuple[float, int]]]:
        """(bytes written up to time t, the writes after it, oldest first), scanning back from the newest: a
        report's time is a forward trip ago, so few writes are later. Before the log's start: its oldest entry."""
        later: list[tuple[float, int]] = []
        for entry in reversed(self.writes):
            if entry[0] <= t:
                later.reverse()
                return entry[1], later
            later.append(entry)
        later.reverse()
        return (later[0][1] if later else 0), later[1:]

    def report(self, now: float, ping_sent: float, mark: int | None, received: int, edge_at: float) -> None:
        """A Pong arrived at `now` for a Ping sent at `ping_sent`: the edge had received `received` bytes at
        `edge_at` (its clock). `mark`: bytes written here up to and including that Ping (None: unknown)."""
        self.reports += 1
        self.reported_at = now
        self.rtt_min = min(self.rtt_min, now - ping_sent)
        self.clock = min(self.clock, now - edge_at)
        # The two byte counts start at different points (the handshake); the edge read its count after the Ping, so
        # it holds at least everything up to it: mark - received <= offset, with equality when nothing behind the
        # Ping had arrived yet (an idle link, or one without a queue). The largest such bound is the offset.
        if mark is not None:
            self.offset = mark - received if self.offset is None else max(self.offset, mark - received)
        readings = self._readings
        if readings and (edge_at <= readings[-1][0] or received < readings[-1][1]):
            return                   # out of order (cannot happen on one TCP stream, but never trust a peer)
        # The bytes that had left here one forward trip before the reading and had not arrived are queued.
        at = edge_at + self.clock - self.rtt_min
        written_then, later = self._since(at)
        self.queue = max(0, written_then - self.offset - received) if self.offset is not None else 0
        # Queued at the reading: what arrives from then on is the link's, while this side keeps KV waiting.
        readings.append((edge_at, received, self.queue > (self.bw * QUEUED_SECONDS if self.bw else PIECE_MIN),
                         now))
        while len(readings) > 2 and edge_at - readings[1][0] >= SAMPLE_SECONDS:
            readings.popleft()
        t0, b0, _, arrived = readings[0]
        # The link set the pace over the span only if every reading in it found a queue (a queue at its start alone
        # may drain while this side encodes the next frame: the span then measured the encoder) and this side had
        # no idle moment since (nor just before).
        busy = all(r[2] for r in readings) and self.idle_at < arrived - self.rtt_min
        if edge_at - t0 >= SAMPLE_SECONDS and received > b0:
            # A span queued throughout measured the link; any other measured this side's pace (or its encoder),
            # which counts only above the rate known (the probe found more) and never starts an estimate.
            sample = (received - b0) / (edge_at - t0)
            if busy or (self.bw is not None and sample > self.bw):
                self._samples.append(sample)
                self.bw = max(self._samples)
        if not self.sampled:
            self._first_estimate(edge_at, received, at - ping_sent)
        if self.bw is None or self.offset is None:
            return
        self.queued = self.queue > self.bw * QUEUED_SECONDS
        self.ever_queued = self.ever_queued or self.queued
        rate = self.rate(now)
        assert rate is not None       # bw is known
        free, prev = at + self.queue / self.bw, written_then
        for t, total in later:        # the writes since, through the modelled bottleneck
            free = max(free, t) + (total - prev) / rate
            prev = total
        self.free_at = free

    def _first_estimate(self, edge_at: float, received: int, wait: float) -> None:
        """Before the first sample (a connection's first KV, often one burst that then drains): a Ping that
        reached the edge `wait` seconds later than an unqueued byte would have waited behind a queue, so the link
        was busy for those seconds before its reading, and the bytes received since an earlier reading within
        them (at least `FIRST_SECONDS` and `PIECE_MIN` bytes back) came at the link's rate. The largest such rate
        is a first estimate, paced at until the first sample of `SAMPLE_SECONDS` replaces it (higher or lower)."""
        if wait < FIRST_SECONDS:
            return
        best = max(((received - b) / (edge_at - t) for t, b, _, _ in self._readings
                    if FIRST_SECONDS <= edge_at - t <= wait + FIRST_SLACK and received - b >= PIECE_MIN), default=None)
        if best is not None and (self.bw is None or best > self.bw):
            self.bw = best


class Pacer:
    """One KV-carrying connection's write path below its outbox (see the module's docstring)."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.enabled = True                 # False: frames cut and the backlog bounded, but never paced
        self.probe = True                   # False: no probe train (a parallel core's stream ports: rank 0's probes)
        self.model = LinkModel(writes=peer.log_writes())
        peer.on_report = self._report
        self._last_ping = -math.inf
        self._kv_at = -math.inf             # when the last KV frame was written
        self._probed = False                # the connection's probe train was sent (or not sent, for good)

    @property
    def piece_bytes(self) -> int:
        """A frame lasts `PIECE_SECONDS` of the link, but is cut below `UNPACED_PIECE` only on a link that has
        queued (the link, not this side or the edge, sets the pace) and would carry that size in over twice as
        long: a fast link's frames stay as large as a handover's pieces (each frame carries codec parameters)."""
        bw = self.model.bw
        if bw is None:
            return UNPACED_PIECE
        timed = bw * PIECE_SECONDS
        if timed >= UNPACED_PIECE / 2 or not self.model.ever_queued:
            return int(min(PIECE_MAX, max(UNPACED_PIECE, timed)))
        return int(max(PIECE_MIN, timed))

    def _report(self, now: float, ping_sent: float, mark: int | None, pong: m.Pong) -> None:
        self.model.report(now, ping_sent, mark, pong.received, pong.at_us / 1e6)

    async def wait(self, outbox: Outbox) -> bool:
        """Wait until a KV frame may be written (True), or an urgent item is queued (False: send it first)."""
        while True:
            if outbox.has_urgent():
                return False
            now = time.monotonic()
            if self.enabled and now - self._last_ping >= REPORT_SECONDS:
                await self._ping()
                continue
            if self.peer.unsent() > 2 * self.piece_bytes:
                await outbox.wait_urgent(0.002)
                continue
            delay = self.model.delay(now) if self.enabled else 0.0
            if delay > 0:
                await outbox.wait_urgent(min(delay, REPORT_SECONDS))
                continue
            return True

    async def idle(self, outbox: Outbox) -> None:
        """The sender has nothing to send; returns once something is queued. While the byte counts' offset is
        unknown (a connection's start), a Ping now finds the path empty and measures it exactly. While no rate
        has been sampled and KV was written in the last `IDLE_REPORTS` seconds, Pings go on every
        `REPORT_SECONDS`: a first burst still crossing the link gives a first rate (`LinkModel.first`), so the
        next one is paced."""
        model = self.model
        model.idle_at = time.monotonic()
        if self.enabled and self.probe and not self._probed and self._kv_at == -math.inf:
            await self._probe(outbox)
        if self.enabled and ((model.offset is None and model.idle_at - self._last_ping >= REPORT_SECONDS) or
                             (not model.sampled and model.idle_at - self._kv_at < IDLE_REPORTS)):
            await self._ping()            # (right behind the last frame: its wait spans the queue ahead)
        while outbox.empty() and not outbox.closed:
            now = time.monotonic()
            if not self.enabled or model.sampled or now - self._kv_at >= IDLE_REPORTS:
                await outbox.wait_ready(None)
                break
            if now - self._last_ping >= REPORT_SECONDS:
                await self._ping()
            await outbox.wait_ready(max(0.0, self._last_ping + REPORT_SECONDS - time.monotonic()))
        model.idle_at = time.monotonic()      # no KV to send until now: a span from before is not the link's

    async def _probe(self, outbox: Outbox) -> None:
        """A connection's start, before any KV: a Ping finds the path empty (the byte counts' offset, the least round
        trip); once its Pong has come with a byte count, `PROBE_TRAIN` Pings padded with `PROBE_PAD` bytes each go
        back to back. At the bottleneck each waits behind those before it, so their reports give a first rate
        (`LinkModel.first`; below ~10 Mbit/s the train lasts a full sample) on a link slow enough for the train to
        last `FIRST_SECONDS`: the first request's KV is paced already and its first token does not wait behind it.
        Not sent to an edge that reports no byte counts (an older release); cut short once anything is queued (a
        request already prefilling when the train starts still finds it on the path)."""
        self._probed = True
        await self._ping()
        deadline = time.monotonic() + PROBE_WAIT
        while self.model.offset is None and outbox.empty() and not outbox.closed and time.monotonic() < deadline:
            await outbox.wait_ready(REPORT_SECONDS)
        if self.model.offset is None or not outbox.empty() or outbox.closed:
            return
        for _ in range(PROBE_TRAIN):
            if not outbox.empty() or outbox.closed:
                return
            self._last_ping = time.monotonic()
            await self.peer.ping(PROBE_PAD)

    async def _ping(self) -> None:
        self._last_ping = time.monotonic()
        await self.peer.ping()

    def sent(self, nbytes: int) -> None:
        """A KV frame of `nbytes` was written: the model's bottleneck carries it."""
        self._kv_at = time.monotonic()
        if self.enabled:
            self.model.wrote(self._kv_at, nbytes)
