"""Decode handover of one remote prefill, at the edge: the tokens a core decodes, pushed into the request here.

Life cycle (a version-3 core asked to decode, `core_decode` > 0; the per-request rules live in the sans-IO
`CoreDecode`, protocol/handover.py, whose phases this follows): PrefillDone's first token (`on_first`) and then
each Token the core decodes (`on_token`, in position order; a late one after the handover is dropped) is
pushed into the reserved request (`push_token`: its stop rules, text and logprobs run here, and the client
sees it at once). A token that ends the request makes it FINISHED: it never moves (the core hears Cancel). The
core's DecodeStop (`on_stop`) ends its stream. Once the KV is complete, `hand_over` sends Handover(position)
and `take_over` joins the request to the edge's batch (the tokens the core decoded are recomputed here as one
short chunk); `await_stop` then waits a little for the core's DecodeStop, for the metrics only. If the
transfer fails after the first token, `recover` keeps the tokens the client has and computes the rest from
the edge's cached prefix.

    FIRST --on_first--> STREAMING --on_token--> STREAMING --on_stop--> STOPPED
                           |                                             |
                           +---------------- hand_over() ----------------+--> HANDED_OVER (late Tokens dropped)
                           +------ a pushed token ends it | recover() ---+--> FINISHED    (late Tokens dropped)
    (a broken rule raises HandoverError, a ProtocolError: the transfer fails)

A push the engine refuses (the token is not one of this model's) fails the transfer through `fail`, the
`KVReceiver`'s, which always raises.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import NoReturn

from edgecore.edge.core_client import CoreClient
from edgecore.edge.prefill_plan import PrefillPlan
from edgecore.edge.transfer_metrics import TransferMetrics
from edgecore.protocol import messages as m
from edgecore.protocol.errors import ProtocolError
from edgecore.protocol.handover import CoreDecode, Phase
from edgecore.shared.engine.handle import EngineHandle
from edgecore.shared.errors import RequestError

STOP_WAIT_SECONDS = 2.0     # how long a takeover waits for the core's DecodeStop (its reason is counted)


class HandoverFollower:
    def __init__(self, handle: EngineHandle, plan: PrefillPlan, fail: Callable[[str], NoReturn],
                 metrics: TransferMetrics):
        """`plan.core_decode` > 0: the tokens the core may decode after the first; `fail(why)` fails the
        transfer (it raises)."""
        self.handle, self.plan, self.fail, self.metrics = handle, plan, fail, metrics
        self.request_id = plan.request_id
        self.core = CoreDecode(plan.request_id, plan.core_decode)

    @property
    def awaiting_first(self) -> bool:
        return self.core.phase is Phase.FIRST

    @property
    def finished(self) -> bool:
        """The request ended before the handover (or the edge computes the rest itself, `recover`)."""
        return self.core.phase is Phase.FINISHED

    @property
    def core_tokens(self) -> int:
        """Output tokens the edge took from the core (the first one included)."""
        return self.core.core_tokens

    @property
    def outcome(self) -> str:
        """How a handover ended, for the metrics: the core had refused to decode, or the edge took over."""
        return "refused" if self.core.stop_reason == "refused" else "taken_over"

    # ---- the core's events ----------------------------------------------------------------------
    async def on_first(self, done: m.PrefillDone) -> None:
        self.core.on_first(done)
        await self._push(done.first_token, done.logprob, done.top_logprobs, done.cached_tokens)

    async def on_token(self, tok: m.Token) -> None:
        if self.core.on_token(tok):
            await self._push(tok.token_id, tok.logprob, tok.top_logprobs)
            self.metrics.core_token()

    def on_stop(self, stop: m.DecodeStop) -> None:
        self.core.on_stop(stop)

    async def _push(self, token: int, logprob: float, top: list[tuple[int, float]],
                    cached_tokens: int | None = None) -> None:
        try:
            finished = await self.handle.push_token(self.request_id, self.plan.token(token, logprob, top,
                                                                                     cached_tokens))
        except RequestError as exc:      # the core's token is not one of ours: the transfer failed
            self.fail(str(exc))
        if finished:
            self.core.finish()           # it ended before the handover: it never moves

    # ---- the edge's moves -----------------------------------------------------------------------
    async def hand_over(self, client: CoreClient) -> None:
        """The KV is complete and written: Handover at the core, and the request joins the edge's batch."""
        await client.send(self.core.handover())
        await self.handle.take_over(self.request_id, self.plan.total_tokens)

    async def await_stop(self, events: asyncio.Queue) -> None:
        """After the takeover, for the metrics only: the core's DecodeStop says whether it had refused to decode
        (sent right after PrefillDone, it may come after a small prompt's KV) or answers the Handover."""
        with contextlib.suppress(asyncio.TimeoutError, ProtocolError):
            async with asyncio.timeout(STOP_WAIT_SECONDS):
                while self.core.stop_reason is None:
                    ev = await events.get()
                    if isinstance(ev, m.DecodeStop):
                        self.core.on_stop(ev)
                    elif not isinstance(ev, m.Token):     # an error or a lost link: no answer is coming
                        return

    async def recover(self) -> bool:
        """The transfer failed after the first token: the tokens the client has are kept and the rest is
        computed here from the edge's cached prefix; False when the request ended (aborted) meanwhile."""
        self.core.finish()
        try:
            await self.handle.take_over(self.request_id, self.plan.skip_tokens)
        except RequestError:
            return False
        self.metrics.handover(self.core_tokens, "recovered", "core_failed")
        return True
