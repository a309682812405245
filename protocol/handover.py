"""Decode handover of one request, sans-IO: the edge's view of the tokens a core decodes for it.

Life cycle (protocol version 3; positions count output tokens, 0 is PrefillDone's first token):

    FIRST --PrefillDone(0)--> STREAMING --Token(next)--> STREAMING      (each token is emitted once, in order)
                                  |  \\--DecodeStop--> STOPPED           (the core sends no more; wait for the KV)
                                  |                        |
                                  +------ handover() ------+--> HANDED_OVER   (Handover(position) is sent; the
                                  |                        |     edge decodes from `position`; late Tokens
                                  |                        |     and the core's DecodeStop are dropped)
                                  +------ finish() --------+--> FINISHED      (the request ended before moving:
                                                                             Cancel stops the core)
    any state --fail(why)--> FAILED  (a gap, a token from the wrong request, a token after DecodeStop)

`on_first`/`on_token` return True when the token is new (the caller emits it) and False when it must be
dropped (it arrived after the edge took over). A Token that skips a position, repeats one before the
handover, or comes after DecodeStop is a protocol error (`HandoverError`): the caller fails the request's
transfer. The core's side keeps only a counter (core/prefill_service.py); its `DecodeStop` says why it
stopped ("refused", "bound", "handover", "finished", "cancelled").
"""

from __future__ import annotations

import enum

from edgecore.protocol import messages as m
from edgecore.protocol.errors import ProtocolError


class HandoverError(ProtocolError):
    """The core's token stream broke the handover rules (gap, repeat, token after DecodeStop)."""


class Phase(enum.Enum):
    FIRST = "first"                  # waiting for PrefillDone
    STREAMING = "streaming"          # the core decodes; its tokens are emitted as they come
    STOPPED = "stopped"              # the core said DecodeStop; the edge waits for the KV
    HANDED_OVER = "handed_over"      # the edge decodes; core tokens from here on are dropped
    FINISHED = "finished"            # the request ended before the handover
    FAILED = "failed"


class CoreDecode:
    def __init__(self, request_id: str, limit: int):
        """`limit`: the most tokens after the first that the edge lets the core decode (PrefillRequest's
        `core_decode`); 0 means the old mode (no Token frames expected)."""
        self.request_id, self.limit = request_id, limit
        self.phase = Phase.FIRST
        self.next_position = 0           # the next output position the edge does not hold yet
        self.stop_reason: str | None = None
        self.dropped = 0                 # core tokens that arrived after the edge took over

    @property
    def core_tokens(self) -> int:
        """Output tokens the edge took from the core (the first one included)."""
        return self.next_position

    def on_first(self, done: m.PrefillDone) -> bool:
        self._own(done.request_id)
        if self.phase is not Phase.FIRST:
            self.fail(f"a second PrefillDone in phase {self.phase.value}")
        self.phase, self.next_position = Phase.STREAMING, 1
        if self.limit == 0:
            self.phase, self.stop_reason = Phase.STOPPED, "none asked"
        return True

    def on_token(self, tok: m.Token) -> bool:
        self._own(tok.request_id)
        if self.phase in (Phase.HANDED_OVER, Phase.FINISHED):
            self.dropped += 1
            return False
        if self.phase is not Phase.STREAMING:
            self.fail(f"Token at position {tok.position} in phase {self.phase.value}")
        if tok.position != self.next_position:
            self.fail(f"Token at position {tok.position}, expected {self.next_position}")
        if tok.position > self.limit:
            self.fail(f"Token at position {tok.position} beyond the {self.limit} tokens allowed")
        self.next_position += 1
        return True

    def on_stop(self, stop: m.DecodeStop) -> None:
        self._own(stop.request_id)
        if self.phase is Phase.STREAMING:
            if stop.position != self.next_position:
                self.fail(f"DecodeStop at position {stop.position} after {self.next_position} tokens")
            self.phase, self.stop_reason = Phase.STOPPED, stop.reason
        elif self.phase in (Phase.FIRST, Phase.STOPPED, Phase.FAILED):
            self.fail(f"DecodeStop in phase {self.phase.value}")
        elif self.stop_reason is None:   # HANDED_OVER / FINISHED: the core's answer to Handover or Cancel, or a
            self.stop_reason = stop.reason    # stop sent before it ("refused" right after PrefillDone): noted

    def handover(self) -> m.Handover:
        """The edge holds the prompt's KV and takes over at `next_position`."""
        if self.phase not in (Phase.STREAMING, Phase.STOPPED):
            raise HandoverError(f"cannot hand over in phase {self.phase.value}")
        self.phase = Phase.HANDED_OVER
        return m.Handover(self.request_id, self.next_position)

    def finish(self) -> None:
        """The request ended (stop rule, abort) before the handover: the core must hear Cancel."""
        if self.phase is not Phase.FAILED:
            self.phase = Phase.FINISHED

    def fail(self, why: str) -> None:
        self.phase = Phase.FAILED
        raise HandoverError(f"request {self.request_id}: {why}")

    @property
    def core_active(self) -> bool:
        """True while the core may still send tokens the edge would emit."""
        return self.phase in (Phase.FIRST, Phase.STREAMING)

    def _own(self, request_id: str) -> None:
        if request_id != self.request_id:
            self.fail(f"a message of request {request_id}")
