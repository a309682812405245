"""Protocol errors and the error codes carried in Error frames.

A `ProtocolError` is raised by the sans-IO state machine: `LocalProtocolError`
when this side tried something illegal, `RemoteProtocolError` when the peer
sent something illegal (the transport then sends an Error frame with the code
and closes). Request-level failures travel as Error frames naming the request
and leave the connection open.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    PROTOCOL = 1            # malformed frame or illegal message for the state
    VERSION_MISMATCH = 2
    MODEL_MISMATCH = 3
    AUTH_FAILED = 4
    FRAME_TOO_LARGE = 5
    CHECKSUM = 6            # a KV chunk's payload does not match its checksum
    CODEC = 7               # unknown / not negotiated codec, or undecodable payload
    TIMEOUT = 8
    OVERLOADED = 9
    BAD_REQUEST = 10        # request-level: e.g. prompt too long
    CANCELLED = 11
    INTERNAL = 12
    SHUTTING_DOWN = 13


class ProtocolError(Exception):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL):
        super().__init__(message)
        self.code = code


class LocalProtocolError(ProtocolError):
    """This side broke the protocol (a bug or misuse in the caller)."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol or failed a check (auth, model, checksum)."""


class CodecError(ProtocolError):
    def __init__(self, message: str):
        super().__init__(message, ErrorCode.CODEC)
