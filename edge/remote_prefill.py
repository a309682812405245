"""One prefill at a core, seen from the edge: a thin coordinator of the parts, around a sans-IO `KVReceiver`.

The parts (each its own module):
- `PrefillPlan` (edge/prefill_plan.py): what the core is asked, a frozen value built before anything is sent;
- `KVReceiver` (protocol/kv_receiver.py): checks each KVChunk header, PrefillDone, failures; decides Ack or Cancel;
- `ChunkWriter` (edge/chunk_writer.py): unpacks chunk payloads (in worker threads) into the paged cache, and
  the barrier before anything reads the KV;
- `HandoverFollower` (edge/handover_follower.py): the tokens the core decodes, Handover and the take-over;
- `TransferMetrics` (edge/transfer_metrics.py): the transfer metrics and the handover tallies.

Life cycle: `run()` reserves blocks for the prompt through the engine handle (the locally cached prefix becomes
`skip_tokens`; the request's `OutputSink`, chosen by the caller, is given with it), chooses the codec, builds
the plan and sends its PrefillRequest; with `edge_layers` the edge's own layer-0 KV is queued right after it.
Then every event of the request is dispatched by type (`_on_event`): a KVChunk's header to the receiver, its
payload to the chunk writer; PrefillDone to the receiver (and to the follower); Token and DecodeStop to the
follower; a core Error, a broken connection or the transfer timeout fail the receiver. Once the receiver is
COMPLETE and every write is queued (`ChunkWriter.written`), the request is activated with the core's first
token and the core hears Ack. On any failure the writer drops what is in flight, the reservation is released,
the core hears Cancel, and `RemotePrefillFailed` tells the caller to try elsewhere.

Decode handover (a version-3 core, `plan.core_decode` > 0): `run()` returns as soon as the first token is
pushed into the reserved request, and a task (`follow`) goes on: the core's Tokens are pushed, KV chunks are
written as before; once the KV is complete the edge sends Handover and takes over, then Ack. A request that
finishes before that never moves (Cancel). If the transfer fails after the first token the edge keeps the
tokens it has and computes the rest itself (Cancel at the core); a cancelled `follow` (client gone) sends
Cancel at once. Each handover ends with one outcome counted.

    RESERVING --plan, PrefillRequest--> RECEIVING --KV complete, written--> ACTIVATED (Ack)
                                           |  +-- failure --> FAILED (release, Cancel, RemotePrefillFailed)
                                           +-- first token pushed (core_decode > 0) --> FOLLOWING (`follow`)
    FOLLOWING --KV complete, written--> HANDED_OVER (Handover, take_over, Ack)
              --the request ended--> FINISHED (Cancel)     --failure--> RECOVERED (Cancel, take_over(cached))
              --cancelled--> CANCELLED (Cancel)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor

from edgecore.edge.chunk_writer import ChunkWriter
from edgecore.edge.core_client import CoreClient
from edgecore.edge.handover_follower import HandoverFollower
from edgecore.protocol.kv_receiver import KVReceiver, TransferFailed
from edgecore.edge.prefill_plan import PrefillPlan, RemotePrefillSettings
from edgecore.edge.transfer_metrics import TransferMetrics
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ProtocolError
from edgecore.protocol.events import KVData
from edgecore.protocol.transport import PeerError
from edgecore.shared.engine.handle import EngineHandle, EngineRequest, OutputSink
from edgecore.shared.errors import RequestError

Event = m.Message | KVData | BaseException     # what the core client's queue holds for one request
FAILURES = (TransferFailed, asyncio.TimeoutError, PeerError, ProtocolError)   # the transfer failed: fall back


class RemotePrefillFailed(Exception):
    pass


class RemotePrefill:
    def __init__(self, handle: EngineHandle, client: CoreClient, request: EngineRequest, *,
                 settings: RemotePrefillSettings, pool: Executor, metrics: TransferMetrics, adapter_fingerprint: str = ""):
        """`request`: its id, prompt ids, sampling and fairness group (here and at the core); `pool`: the edge's
        chunk unpack workers; `metrics`: the edge's transfer metrics and handover tallies."""
        assert isinstance(request.prompt, list), "a remote prefill's prompt is token ids"
        self.handle, self.client, self.settings, self.metrics = handle, client, settings, metrics
        self.request_id = request.request_id
        self.request = EngineRequest(request.request_id, request.prompt, request.params, group=request.group,
                                     priority=request.priority, cache_salt=request.cache_salt, tenant=request.tenant,
                                     weight=request.weight, adapter=request.adapter,
                                     traceparent=request.traceparent)
        self.adapter_fingerprint = adapter_fingerprint     # of request.adapter: the core must hold the same one
        self.writer = ChunkWriter(handle, request.request_id, pool, settings.rope)
        self.plan: PrefillPlan | None = None            # once reserved and the codec chosen
        self.receiver: KVReceiver | None = None         # made with the plan
        self.follower: HandoverFollower | None = None   # decode handover only
        self.follow: asyncio.Task | None = None         # decode handover: the rest of the transfer, after run()

    async def run(self, choose_codec: Callable[[CoreClient, int], str], sink: OutputSink | None) -> None:
        """Prefill at the core and receive the KV; with a `sink`, the request then decodes here, its outputs going
        to `sink` (None: it is never activated, a prefetch). `choose_codec(client, tokens)` picks the codec."""
        handle, client, rid = self.handle, self.client, self.request_id
        activate = sink is not None
        cached = await handle.reserve(self.request, sink)
        codec = choose_codec(client, len(self.request.prompt) - cached)
        assert client.peer is not None          # a picked core is connected
        plan = self.plan = PrefillPlan.build(self.request, cached, codec, self.settings,
                                             layer0_macs_per_token=handle.layer0_macs_per_token, direct=client.direct,
                                             core_decodes=activate and client.peer.conn.handover,
                                             adapter_fingerprint=self.adapter_fingerprint)
        receiver = self.receiver = plan.receiver(handle.config)
        started = time.perf_counter()
        try:
            if plan.core_decode > 0:
                follower = self.follower = HandoverFollower(handle, plan, receiver.fail, self.metrics)
                events = await self._request(plan)
                while follower.awaiting_first:
                    await self._on_event(receiver, await self._next(events))
                self.follow = asyncio.create_task(self._follow(receiver, follower, events, started))
                return
            events = await self._request(plan)
            while not receiver.complete:
                await self._on_event(receiver, await self._next(events))
            await self.writer.written()
            done = receiver.done
            if activate and done is not None:          # COMPLETE: PrefillDone is in
                try:
                    await handle.activate(rid, plan.token(done.first_token, done.logprob, done.top_logprobs,
                                                          done.cached_tokens))
                except RequestError as exc:      # the core's token is not one of ours: fail over
                    receiver.fail(str(exc))
        except BaseException as exc:
            self._give_up(receiver, str(exc) or type(exc).__name__)
            handle.release(rid)
            await self._close(receiver)
            if isinstance(exc, FAILURES):
                raise RemotePrefillFailed(str(exc) or type(exc).__name__) from None
            raise
        await self._close(receiver)
        self._count(receiver, started)

    async def _request(self, plan: PrefillPlan) -> asyncio.Queue:
        """Send the plan's PrefillRequest; the request's events arrive on the queue returned."""
        events = await self.client.prefill(plan.request())
        if plan.edge_layers:        # while the core computes: queued before every write, activate or take-over
            self.writer.first_layer()
        return events

    async def _next(self, events: asyncio.Queue) -> Event:
        return await asyncio.wait_for(events.get(), self.settings.timeout)

    async def _on_event(self, receiver: KVReceiver, ev: Event) -> None:
        follower = self.follower
        match ev:
            case KVData(chunk=chunk, payload=payload):
                receiver.on_chunk(chunk, len(payload), time.perf_counter())   # the header, before the payload
                self.writer.write(ev)
            case m.PrefillDone():
                receiver.on_done(ev)
                if follower is not None:
                    await follower.on_first(ev)
            case m.Token() if follower is not None:
                await follower.on_token(ev)
            case m.DecodeStop() if follower is not None:
                follower.on_stop(ev)
            case m.Token() | m.DecodeStop():
                receiver.fail(f"a {type(ev).__name__} for a request that did not ask the core to decode")
            case m.Error(code=code, message=message):
                receiver.fail(f"core error {code}: {message}")
            case BaseException():
                receiver.fail(str(ev))

    async def _follow(self, receiver: KVReceiver, follower: HandoverFollower, events: asyncio.Queue,
                      started: float) -> None:
        """After the first token: the core's tokens and the KV until the KV is complete, then Handover and
        take over; on a failure, compute the rest here (see the module's docstring)."""
        try:
            while not receiver.complete and not follower.finished:
                await self._on_event(receiver, await self._next(events))
            if follower.finished:
                self._give_up(receiver, "the request finished before the handover")
                self.metrics.handover(follower.core_tokens, "finished_before", "finished_on_core")
                self._count(receiver, started)
            else:
                await self.writer.written()
                await follower.hand_over(self.client)
                # Counted before the wait for the core's stop below, which the client's reply may outlast.
                self._count(receiver, started)
                await follower.await_stop(events)
                self.metrics.handover(follower.core_tokens, "handovers", follower.outcome)
        except asyncio.CancelledError:
            self._give_up(receiver, "the request was cancelled")
            await self._close(receiver)
            raise
        except FAILURES as exc:
            self._give_up(receiver, str(exc) or type(exc).__name__)
            await self._close(receiver)
            self.metrics.core_failed(computed_here=not follower.finished)
            if not follower.finished:       # the tokens the client has are kept; the rest is computed here
                await follower.recover()
            return
        await self._close(receiver)

    def _count(self, receiver: KVReceiver, started: float) -> None:
        """The transfer's metrics (`started`: when the PrefillRequest was about to leave)."""
        assert self.plan is not None
        self.metrics.transfer(self.plan.codec, receiver.encoded_bytes, receiver.raw_bytes,
                              time.perf_counter() - started, receiver.layer_done_at)

    def _give_up(self, receiver: KVReceiver, why: str) -> None:
        """The transfer is given up: writes still in flight write nothing, and the core will hear Cancel."""
        self.writer.drop()
        receiver.abandon(why)

    async def _close(self, receiver: KVReceiver) -> None:
        """Ack or Cancel at the core (the receiver decides), and the link estimate from this transfer."""
        sample_bytes, span = receiver.bandwidth_sample()
        self.client.finish(self.request_id, sample_bytes, span)
        await self.client.send(receiver.closing_message())   # a lost connection frees the core's copy too
