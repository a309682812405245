"""The core↔edge wire protocol: sans-IO framing and state machine, sealed (encrypted) frames, per-node
credentials, the KV codecs, and the one asyncio transport that does I/O. Imports neither torch nor the rest of
edgecore. The names below are its public API (loaded on first use); everything else is internal.

- connections: `Connection`, `Role`, `State`, `NEED_DATA`, events `KVData`, `BadFrame`, `FrameRejected`
  (state.py, events.py); messages in `messages` (msgspec structs);
- security: `Rekey` (cipher.py), `Authority`, `NodeIdentity`, `Trust`, `Credential` (credentials.py);
- KV: `encode_chunk`, `decode_chunk` (kv.py), the codec registry `CODECS` (codecs/), the receiving side's
  sans-IO bookkeeping `KVReceiver`, `ReceiveState`, `TransferFailed` (kv_receiver.py);
- I/O: `connect`, `serve`, `Peer`, `PeerError`, `Timeouts`, `tls_context` (transport.py);
- errors: `ErrorCode`, `ProtocolError`, `LocalProtocolError`, `RemoteProtocolError` (errors.py).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Connection": "state", "Role": "state", "State": "state", "NEED_DATA": "events", "KVData": "events",
    "BadFrame": "events", "FrameRejected": "events", "Rekey": "cipher", "Authority": "credentials",
    "NodeIdentity": "credentials", "Trust": "credentials", "Credential": "credentials", "encode_chunk": "kv",
    "decode_chunk": "kv", "CODECS": "codecs", "KVReceiver": "kv_receiver", "ReceiveState": "kv_receiver",
    "TransferFailed": "kv_receiver", "connect": "transport", "serve": "transport", "Peer": "transport",
    "PeerError": "transport", "Timeouts": "transport", "tls_context": "transport", "ErrorCode": "errors",
    "ProtocolError": "errors", "LocalProtocolError": "errors", "RemoteProtocolError": "errors",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'edgecore.protocol' has no attribute {name!r}")
    return getattr(importlib.import_module(f"edgecore.protocol.{_WHERE[name]}"), name)
