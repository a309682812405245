"""The edge's receive side of one KV transfer, sans-IO: events in, decisions out.

Life cycle: the edge reserves blocks for a prompt (its cached prefix becomes
`skip_tokens`) and makes a `KVReceiver` for the request. For every KVChunk
header that arrives, `on_chunk` checks it lies inside the request (layers,
tokens [skip_tokens, total_tokens), KV heads) and overlaps nothing received
before — a duplicate, an overlap or an out-of-range chunk fails the transfer —
then records its coverage (layer × token range × head range; chunks may arrive
in any order). A layer is covered when every KV head of every token it still
needs has arrived: `needed_from[layer]` on (a sliding-window or chunked layer
needs only the window or chunk the next decode steps can see; a full layer every
token from `skip_tokens`); tokens before that may arrive too and count for nothing. `on_done` takes the core's PrefillDone: from a single sender
every chunk precedes it, so the KV must then be complete; with direct streams
(a parallel core's ranks each send their own layers and heads) chunks from
other ranks may still follow it. The state goes RECEIVING → COMPLETE (PrefillDone
seen and every layer covered: activate, then send `closing_message()`, an Ack)
or FAILED (any error: `closing_message()` is a Cancel, and the core frees the
KV). `bandwidth_sample()` gives the link estimate: the bytes that arrived after
the first chunk over the span they took.

    RECEIVING --on_chunk--> RECEIVING --on_done + full coverage--> COMPLETE
        |                                                   (Ack after activate)
        +-- out of range / overlap / incomplete at PrefillDone / fail() --> FAILED (Cancel)
    (abandon(): the edge gives up, from any state --> FAILED)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NoReturn
from collections.abc import Sequence

import numpy as np

from edgecore.protocol import messages as m
from edgecore.protocol.codecs.base import BITS_DTYPES

VALUE_BYTES = {name: np.dtype(bits).itemsize for name, bits in BITS_DTYPES.items()}   # per K/V value


class ReceiveState(enum.Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


class TransferFailed(Exception):
    """The transfer cannot complete (a bad chunk, missing KV, a core error); the request falls back."""


@dataclass(frozen=True, slots=True)
class _Box:
    token_start: int
    token_end: int
    head_start: int
    head_end: int

    def clipped_area(self, token_start: int) -> int:
        """Token × head cells at or after `token_start`."""
        return max(0, self.token_end - max(self.token_start, token_start)) * (self.head_end - self.head_start)

    def overlaps(self, o: _Box) -> bool:
        return (self.token_start < o.token_end and o.token_start < self.token_end
                and self.head_start < o.head_end and o.head_start < self.head_end)



class KVReceiver:
    def __init__(self, request_id: str, num_layers: int, num_kv_heads: int, total_tokens: int,
                 skip_tokens: int = 0, direct: bool = False, needed_from: Sequence[int] | None = None,
                 values_per_head: int | None = None):
        """`needed_from`: per layer, the first token it needs (shared/kv/transfer.py `needed_from`); None:
        every layer needs every token from `skip_tokens`. `values_per_head`: K and V values per layer, token
        and KV head in this model (the latent's, for MLA): a chunk whose `raw_len` says otherwise is refused
        before it is decoded (its decoder would allocate what the header declares)."""
        if not 0 <= skip_tokens < total_tokens:
            raise ValueError(f"skip_tokens {skip_tokens} must be below the prompt length {total_tokens}")
        if needed_from is not None and len(needed_from) != num_layers:
            raise ValueError(f"needed_from has {len(needed_from)} layers, the model {num_layers}")
        self.request_id = request_id
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.total_tokens, self.skip_tokens = total_tokens, skip_tokens
        self.direct = direct
        self.values_per_head = values_per_head
        self.state = ReceiveState.RECEIVING
        self.done: m.PrefillDone | None = None
        self.failure: str | None = None
        self._boxes: list[list[_Box]] = [[] for _ in range(num_layers)]
        self._start = [min(max(skip_tokens, s), total_tokens) for s in (needed_from or [0] * num_layers)]
        self._covered = [0] * num_layers
        self.layer_done_at: list[float | None] = [None] * num_layers     # when each layer's KV was complete
        self._missing_layers = sum(1 for layer in range(num_layers) if self.needed(layer))
        self.encoded_bytes = self.raw_bytes = 0
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._first_bytes = 0

    @property
    def per_layer(self) -> int:
        """Token × head cells a full-attention layer must receive."""
        return (self.total_tokens - self.skip_tokens) * self.num_kv_heads

    def needed(self, layer: int) -> int:
        """Token × head cells `layer` must receive (its window only, for a windowed layer)."""
        return (self.total_tokens - self._start[layer]) * self.num_kv_heads

    @property
    def complete(self) -> bool:
        return self.state is ReceiveState.COMPLETE

    @property
    def covered(self) -> bool:
        return self._missing_layers == 0

    # ---- events ----------------------------------------------------------------------------
    def on_chunk(self, c: m.KVChunk, encoded_bytes: int, now: float) -> None:
        """A chunk's header (before its payload is decoded): check it, record what it covers."""
        self._expect_receiving()
        if not (0 <= c.layer_start < c.layer_end <= self.num_layers
                and self.skip_tokens <= c.token_start < c.token_end <= self.total_tokens
                and 0 <= c.head_start < c.head_end <= self.num_kv_heads):
            self.fail(f"chunk outside the request: {c}")
        if self.values_per_head is not None:
            values = (c.layer_end - c.layer_start) * (c.token_end - c.token_start) * (c.head_end - c.head_start)
            expected = values * self.values_per_head * VALUE_BYTES.get(c.dtype, 0)
            if c.raw_len != expected:
                self.fail(f"a {c.dtype} chunk of {c.raw_len} raw bytes where this model's KV takes {expected}: {c}")
        box = _Box(c.token_start, c.token_end, c.head_start, c.head_end)
        for layer in range(c.layer_start, c.layer_end):
            if any(box.overlaps(b) for b in self._boxes[layer]):
                self.fail(f"layer {layer} received tokens [{c.token_start}, {c.token_end}) × heads "
                          f"[{c.head_start}, {c.head_end}) twice")
        for layer in range(c.layer_start, c.layer_end):
            self._boxes[layer].append(box)
            area = box.clipped_area(self._start[layer])
            if area:
                self._covered[layer] += area
                if self._covered[layer] == self.needed(layer):
                    self._missing_layers -= 1
                    self.layer_done_at[layer] = now
        self.encoded_bytes += encoded_bytes
        self.raw_bytes += c.raw_len
        self._last_at = now
        if self._first_at is None:
            self._first_at, self._first_bytes = now, encoded_bytes
        self._maybe_complete()

    def on_done(self, done: m.PrefillDone) -> None:
        self._expect_receiving()
        if self.done is not None:
            self.fail("a second PrefillDone")
        self.done = done
        if not self.direct and not self.covered:      # one sender: all of its KV came first
            self.fail(f"incomplete KV at PrefillDone: token×heads per layer {self._covered}, expected "
                      f"{[self.needed(layer) for layer in range(self.num_layers)]}")
        self._maybe_complete()

    def fail(self, why: str) -> NoReturn:
        """Fail the transfer (also for errors found outside: a core Error, a timeout, a bad payload)."""
        if self.state is ReceiveState.RECEIVING:
            self.state, self.failure = ReceiveState.FAILED, why
        raise TransferFailed(why)

    def abandon(self, why: str) -> None:
        """The edge gives the transfer up (its request was cancelled, activation failed): FAILED, so the
        core hears Cancel."""
        if self.state is not ReceiveState.FAILED:
            self.state, self.failure = ReceiveState.FAILED, why

    # ---- decisions -------------------------------------------------------------------------
    def closing_message(self) -> m.Ack | m.Cancel:
        """What the core must hear when the edge is done with the transfer: Ack frees the core's copy after
        a complete transfer; Cancel after anything else."""
        return m.Ack(self.request_id) if self.complete else m.Cancel(self.request_id)

    def bandwidth_sample(self) -> tuple[int, float]:
        """(bytes, seconds): the bytes that arrived after the first chunk, over the span they took."""
        if self._first_at is None or self._last_at is None:
            return 0, 0.0
        return self.encoded_bytes - self._first_bytes, self._last_at - self._first_at

    def _expect_receiving(self) -> None:
        if self.state is not ReceiveState.RECEIVING:
            raise TransferFailed(f"transfer of {self.request_id} is already {self.state.value}")

    def _maybe_complete(self) -> None:
        if self.done is not None and self.covered:
            self.state = ReceiveState.COMPLETE
