"""Typed payloads of a KV transfer, passed between threads and processes instead of positional tuples.

Life cycle: a `KVSlice` is cut out of a paged pool (core: a computed layer
range of a prefill-only request, or a gathered piece of a parallel core), travels
to the connection's sender (encoded as a KVChunk), and on the edge is decoded
into a new `KVSlice` that the engine writes into its own pool. A `StreamRoute`
is made by a parallel core's driver for a request whose edge holds a stream
connection to every rank, travels once in a step plan, and tells each rank where
its own layers and heads of that request go.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch


@dataclass(frozen=True, slots=True)
class KVSlice:
    """K and V of layers [layer, layer + k.shape[0]) × tokens [token_start, token_end) × heads
    [head_start, head_start + k.shape[2]); k and v are [layers, tokens, heads, head_dim]."""
    layer: int
    token_start: int
    token_end: int
    head_start: int
    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]


class StreamRoute(msgspec.Struct, array_like=True, frozen=True):
    """Where a rank sends its own KV of one request: the edge's request id, the session id of the edge's
    connections, the codec, and the token range [skip_tokens, total_tokens)."""
    request_id: str
    session: str
    codec: str
    skip_tokens: int
    total_tokens: int
