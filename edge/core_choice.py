"""Which core prefills one request: each healthy core's predicted time to first token for this very prompt.

Life cycle: the edge engine makes one `CoreChoice` per request at placement (edge/node.py), from the cores'
digests (edge/core_cache.py: what each one's prefix cache holds, its prefill queue) and the measured rates
(edge/placement.py `PrefillModel`). For each core the prediction is

    RTT + (its queue + the prompt tokens it does not hold) × its seconds per token

(a core that sends no digest, an older release: nothing held, and its requests in flight taken as prompts of this
one's length; with `--core-routing rtt`, every core so). The prompt's chained hashes are computed once per block
size, and only as far as a core holds them (`PromptHashes`). `best(exclude)` is the core to try next (a retry
skips the ones that failed); `sent(core)` adds the request's uncached tokens to that core's queue until its next
digest; `describe()` is the text of the request's placement log line. A retry reuses the predictions
made at placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass

from edgecore.edge.core_cache import PromptHashes
from edgecore.edge.core_client import CoreClient
from edgecore.edge.placement import PrefillModel


@dataclass(frozen=True, slots=True)
class Prediction:
    client: CoreClient
    cached: int          # leading prompt tokens the core holds (its digest)
    uncached: int        # prompt tokens it would compute
    seconds: float       # predicted time to first token
    queue: int = 0       # prompt tokens queued there ahead of it (what the prediction assumed)

    @property
    def address(self) -> str:
        return self.client.address


class CoreChoice:
    def __init__(self, clients: Iterable[CoreClient], prompt_ids: list[int], salt: str | None, model: PrefillModel,
                 digests: bool = True):
        """`digests` False (`--core-routing rtt`): every core as one without digests (round trip and load)."""
        n, hashes = len(prompt_ids), PromptHashes(prompt_ids, salt)
        self.predictions: list[Prediction] = []
        for client in clients:
            cache = client.cache
            cached = cache.cached_tokens(hashes) if digests else 0
            queue = cache.queue if digests and cache.known else client.load * n
            seconds = model.predict_core(client.address, client.rtt, n - cached, queue)
            self.predictions.append(Prediction(client, cached, n - cached, seconds, queue))
        self.predictions.sort(key=lambda p: p.seconds)

    def best(self, exclude: Set[str] = frozenset()) -> Prediction | None:
        return next((p for p in self.predictions if p.address not in exclude and p.client.healthy), None)

    def sent(self, prediction: Prediction) -> None:
        prediction.client.cache.prefill_sent(prediction.uncached)

    def describe(self, limit: int = 4) -> str:
        """The cores' predictions, best first: "core ADDR 0.120 s (480 cached)", ..."""
        return ", ".join(f"core {p.address} {p.seconds:.3f} s ({p.cached} cached)"
                         for p in self.predictions[:limit])
