"""Typed payloads of a KV transfer, passed between threads and processes instead of positional tuples.

Life cycle: a `KVSlice` is cut out of a paged pool (core: a computed layer
range of a prefill-only request, or a gathered piece of a parallel core), travels
to the connection's sender (encoded as a KVChunk), and on the edge is decoded
into a new `KVSlice` that the engine writes into its own pool. A `DirectRoute`
is made by a parallel core's driver for a request whose edge holds a stream
connection to every rank, travels once in a step plan, and tells each rank where
its own layers and heads of that request go.

Windowed layers (sliding-window, chunked): the edge's first decode query sits at
the prompt's end, and no later query sees further back, so a windowed layer
needs only the tokens from `needed_from(config, prompt_len)[layer]` on. The core
cuts each layer's slice there (`cut_slice`); the edge counts coverage from there.

Edge-computed first layer: layer 0's K/V depend on each token and its position alone (nothing is
attended before them), so an edge can compute them from the prompt it already holds — an embedding
lookup and one layer's projections — instead of receiving them. A PrefillRequest's `edge_layers`
(at most `EDGE_LAYERS`) says so; both ends then treat those layers as needing no token.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from edgecore.shared.models.config import ModelConfig

EDGE_LAYERS = 1     # leading layers an edge may compute itself: layer 0 only (layer 1 would need attention)


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


def needed_from(config: ModelConfig, position: int, edge_layers: int = 0) -> list[int]:
    """Per layer: the first token any query at `position` or later attends to (0 for a full-attention layer;
    `position` itself for a chunked layer whose chunk starts there). KV before it need not travel. The first
    `edge_layers` layers (0 or 1) need none: the edge computes their KV itself (`EDGE_LAYERS`)."""
    return [position if layer < edge_layers else min(config.attention_of(layer).first_visible(position), position)
            for layer in range(config.num_hidden_layers)]


def layers_at_edge(layer0_macs_per_token: int, tokens: int, budget: float, lossless: bool) -> int:
    """Leading layers an edge computes itself for a transfer of `tokens` tokens: layer 0 (`EDGE_LAYERS`) when the
    codec is lossy (a lossless transfer promises the core's own bits) and its cost — the engine's multiply-adds
    per token (0: it cannot) × tokens — is within `budget`; else none."""
    return EDGE_LAYERS if not lossless and 0 < layer0_macs_per_token * tokens <= budget else 0


def cut_slice(piece: KVSlice, starts: list[int]) -> list[KVSlice]:
    """`piece` without the tokens its layers need not send (`starts` from `needed_from`, by global layer):
    one slice per run of layers with the same first token; nothing for layers that need none of it."""
    out: list[KVSlice] = []
    i, n = 0, piece.num_layers
    while i < n:
        lo = max(piece.token_start, starts[piece.layer + i])
        j = i + 1
        while j < n and max(piece.token_start, starts[piece.layer + j]) == lo:
            j += 1
        if lo < piece.token_end:
            t = lo - piece.token_start
            out.append(KVSlice(piece.layer + i, lo, piece.token_end, piece.head_start,
                               piece.k[i:j, t:], piece.v[i:j, t:]))
        i = j
    return out


class DirectRoute(msgspec.Struct, array_like=True, frozen=True):
    """Where a rank sends its own KV of one request: the edge's request id, the session id of the edge's
    connections, the codec, the token range [skip_tokens, total_tokens), and the leading layers the edge
    computes itself (none of their KV is sent)."""
    request_id: str
    session: str
    codec: str
    skip_tokens: int
    total_tokens: int
    edge_layers: int = 0
