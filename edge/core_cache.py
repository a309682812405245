"""What one core's prefix cache holds, and its queue, as its CacheDigests say (capability "prefix-digest").

Life cycle: a `CoreCache` is made empty for each connection to a core (edge/core_client.py) and `apply`s each
CacheDigest that arrives on it (shared/node/cache_digest.py sends them); a frame with `reset` forgets everything
announced before it. For a prompt, `cached_tokens` is how many leading tokens that core would not compute again:
the whole blocks of the chained hash (shared/kv/block_manager.py `prefix_hashes`, under the request's salt)
announced as held, never the last token, as the core's own prefix cache counts them. `queue` is the prompt
tokens the core said it still has to prefill, plus those this edge sent it since (`sent`), so a burst between two
digests sees the queue grow. A digest is a hint: a wrong one costs time, never a wrong token (the core computes
whatever it does not hold). Bounded: at most MAX_HASHES hashes per core (more announced are not believed), and a
malformed frame (hash bytes not a multiple of 8, a block size outside 1..MAX_BLOCK_SIZE) is ignored and counted.
A prompt's hashes (`PromptHashes`) are computed lazily, one block at a time and only as far as some core holds
them, so a core cannot make each request hash a long prompt in full on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from edgecore.protocol import messages as m
from edgecore.shared.kv.block_manager import chained_hashes

MAX_HASHES = 1 << 20        # per core: 8 M tokens at 8-token blocks; a set of them is ~100 MB at most
MAX_BLOCK_SIZE = 1024


class PromptHashes:
    """One prompt's chained block hashes under one salt, per block size, computed only as far as asked; never the
    block holding the last token's position beyond the full blocks of the first len - 1 tokens (as the core counts)."""

    def __init__(self, prompt_ids: Sequence[int], salt: str | None) -> None:
        self.ids, self.salt = prompt_ids, salt
        self._by_size: dict[int, tuple[list[int], Iterator[int]]] = {}

    def get(self, size: int, i: int) -> int | None:
        """The hash of block `i` at block size `size`; None past the prompt's last countable block."""
        if size not in self._by_size:
            self._by_size[size] = [], chained_hashes(self.ids, size, len(self.ids) - 1, self.salt)
        done, more = self._by_size[size]
        while len(done) <= i:
            h = next(more, None)
            if h is None:
                return None
            done.append(h)
        return done[i]


class CoreCache:
    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.block_size = 0
        self.queued_tokens = 0       # the core's prefill queue at its last digest
        self.sent = 0                # prompt tokens this edge sent it since that digest
        self.digests = 0             # frames applied
        self.malformed = 0           # frames ignored

    @property
    def known(self) -> bool:
        """A digest has arrived on this connection: the core's cache and queue are known."""
        return self.digests > 0

    @property
    def queue(self) -> int:
        return self.queued_tokens + self.sent

    def apply(self, digest: m.CacheDigest) -> None:
        if not 1 <= digest.block_size <= MAX_BLOCK_SIZE or len(digest.stored) % 8 or len(digest.evicted) % 8:
            self.malformed += 1
            return
        if digest.reset or digest.block_size != self.block_size:
            self.hashes = set()
            self.block_size = digest.block_size
        self.hashes.difference_update(np.frombuffer(digest.evicted, "<u8").tolist())
        room = MAX_HASHES - len(self.hashes)
        if room > 0:
            self.hashes.update(np.frombuffer(digest.stored, "<u8")[:room].tolist())
        self.queued_tokens, self.sent = max(0, digest.queued_tokens), 0
        self.digests += 1

    def cached_tokens(self, hashes: PromptHashes) -> int:
        """Leading tokens of the prompt whose `hashes` these are that this core holds (0 before its first digest)."""
        held = 0
        while self.hashes:
            h = hashes.get(self.block_size, held)
            if h is None or h not in self.hashes:
                break
            held += 1
        return held * self.block_size

    def prefill_sent(self, tokens: int) -> None:
        """`tokens` more sent to the core (negative: a prefill counted but never sent)."""
        self.sent = max(0, self.sent + tokens)
