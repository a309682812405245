"""The protocol's state table: which side may send which message in which state (protocol/state.py walks it).

Life cycle: fixed at import. `TRANSITIONS` maps (sending role, state, message type) to the next state, for
sending and receiving alike; `next_state` adds what depends on the connection's version (handover messages from
version 3, Draining from 4) and on the message (an Error without a request closes). The capability rules
(CacheDigest, BlockPull) are the connection's: they depend on what each side listed in its Auth / AuthOk.
"""

from __future__ import annotations

import enum

from edgecore.protocol import messages as m


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    START = "START"
    HELLO = "HELLO"
    WELCOME = "WELCOME"
    AUTH = "AUTH"
    READY = "READY"
    CLOSED = "CLOSED"
    ERROR = "ERROR"


C, S = Role.CLIENT, Role.SERVER
READY_FROM = {
    C: (m.PrefillRequest, m.Ack, m.Cancel, m.Ping, m.Pong, m.Error, m.Reject, m.Handover, m.BlockPull),
    S: (m.KVChunk, m.PrefillDone, m.Ping, m.Pong, m.Error, m.Reject, m.Token, m.DecodeStop, m.Draining,
        m.CacheDigest, m.BlockPullDone),
}
# (role that sends, state, message type) → next state. Sending and receiving both use it.
TRANSITIONS: dict[tuple[Role, State, type], State] = {
    (C, State.START, m.Hello): State.HELLO,
    (S, State.HELLO, m.Welcome): State.WELCOME,
    (C, State.WELCOME, m.Auth): State.AUTH,
    (S, State.AUTH, m.AuthOk): State.READY,
    **{(role, State.READY, cls): State.READY for role, types in READY_FROM.items() for cls in types},
}


def next_state(sender: Role, state: State, msg: m.Message, version: int | None = m.PROTOCOL_VERSION) -> State | None:
    """The state after `sender` sends `msg` in `state` on a connection of `version`; None when forbidden."""
    if state in (State.CLOSED, State.ERROR):
        return None
    if (version or 0) < m.HANDOVER_VERSION and (isinstance(msg, m.HANDOVER_MESSAGES) or
                                                (isinstance(msg, m.PrefillRequest) and msg.core_decode)):
        return None
    if (version or 0) < m.DRAIN_VERSION and isinstance(msg, m.DRAIN_MESSAGES):
        return None
    if isinstance(msg, m.Error) and (not msg.request_id or state is not State.READY):
        return State.CLOSED
    return TRANSITIONS.get((sender, state, type(msg)))
