"""Where to prefill: the measured crossover between edge-local and core prefill.

Life cycle: every finished prefill reports its time-to-first-token and the
number of tokens it prefilled (`observe_local`, `observe_remote`); the model
keeps EWMAs of the local seconds per token and, per core, of the remote
seconds per token beyond the round trip. `local_is_faster(tokens, rtt)`
compares the predictions; until both sides have been measured the fixed
threshold decides. So that a core's estimate does not go stale while every
prompt stays local, one in `explore_every` prompts that the fixed threshold
would have sent to the core still goes there. `predict_ttft` turns the same
rates into the edge's predicted time to first token for a new request (the
`edgecore:predicted_ttft_seconds` gauge, an autoscaling signal). `predict_core` and `predict_local` are the
per-request predictions that prefix-aware routing compares (edge/core_choice.py): the tokens a place would
compute, behind its prefill queue, at its rate; a rate not measured yet is borrowed (another core's, the
edge's) or, with nothing measured, PRIOR_SECONDS_PER_TOKEN. The measured rates include the queueing their
prefills met: each request is measured over its own tokens plus the queue it was predicted to wait behind
(edge/progress.py), so the rates and the predictions count the same work. A first-order model: a batch of prefills
sharing steps, decode steps and a queue that changes while a request waits are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable

PRIOR_SECONDS_PER_TOKEN = 1e-3     # before anything is measured: a small model on a few CPU cores
EXPLORE_LOCAL_BELOW = 512          # the longest uncached suffix prefilled here only to measure this edge's rate


class PrefillModel:
    def __init__(self, fallback_threshold: int = 32, alpha: float = 0.3, explore_every: int = 16):
        self.fallback = fallback_threshold
        self.alpha = alpha
        self.explore_every = explore_every
        self._local_picks = 0
        self._remote_picks = 0
        self.local_per_token: float | None = None
        self.remote_per_token: dict[str, float] = {}

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_local(self, tokens: int, seconds: float) -> None:
        if tokens >= 8:
            self.local_per_token = self._ewma(self.local_per_token, seconds / tokens)

    def observe_remote(self, core: str, tokens: int, seconds: float, rtt: float) -> None:
        if tokens >= 8:
            self.remote_per_token[core] = self._ewma(self.remote_per_token.get(core),
                                                     max(0.0, seconds - rtt) / tokens)

    def core_rate(self, core: str) -> float:
        """Seconds per prompt token at `core`: measured, else the best measured core's, else the edge's, else the
        prior."""
        rate = self.remote_per_token.get(core)
        if rate is None and self.remote_per_token:
            rate = min(self.remote_per_token.values())
        return rate if rate is not None else self.local_per_token or PRIOR_SECONDS_PER_TOKEN

    def predict_core(self, core: str, rtt: float, uncached: int, queue: int) -> float:
        """Time to first token at `core`: the round trip, then its `queue` of prompt tokens and the `uncached`
        ones this prompt adds."""
        return rtt + (max(0, queue) + uncached) * self.core_rate(core)

    def predict_local(self, uncached: int, queue: int) -> float | None:
        """Time to first token here behind `queue` prompt tokens; None before a local prefill was measured."""
        if self.local_per_token is None:
            return None
        return (max(0, queue) + uncached) * self.local_per_token

    def local_is_faster(self, tokens: int, core: str, core_seconds: float, queue: int = 0) -> bool:
        """Prefill here (`tokens` uncached here, behind `queue` prompt tokens) rather than at `core`, predicted to
        take `core_seconds` (`predict_core`); the fixed threshold until both sides were measured. While this
        edge has never prefilled a prompt of 8 tokens or more itself (every prompt went to a core), one in
        `explore_every` of those the threshold sends away (up to `EXPLORE_LOCAL_BELOW` tokens) is prefilled here,
        so that its own rate gets measured at all."""
        local = self.predict_local(tokens, queue)
        if local is None or core not in self.remote_per_token:
            if local is None and tokens >= self.fallback and tokens <= EXPLORE_LOCAL_BELOW:
                self._remote_picks += 1
                return self._remote_picks % self.explore_every == 0
            return tokens < self.fallback
        local = local <= core_seconds
        if local and tokens >= self.fallback:
            self._local_picks += 1
            if self._local_picks % self.explore_every == 0:
                return False            # refresh the core's estimate now and then
        return local

    def predict_ttft(self, tokens: float, waiting: int, cores: Iterable[tuple[str, float]]) -> float | None:
        """Predicted time to first token of a request of `tokens` prompt tokens arriving now behind `waiting`
        queued requests of the same size: the `waiting + 1` prompts prefilled one after another at the best
        measured rate, here or at one of `cores` ((address, rtt) of the healthy ones: plus its round trip).
        A first-order model: it ignores prefix-cache hits and decode steps sharing the engine. None until a
        rate has been measured."""
        work = (waiting + 1) * tokens
        options = [work * self.local_per_token] if self.local_per_token is not None else []
        options += [rtt + work * self.remote_per_token[core] for core, rtt in cores if core in self.remote_per_token]
        return min(options) if options else None

    def crossover(self, core: str, rtt: float) -> float | None:
        """Prompt length above which the core is faster (None: not measured, or never)."""
        remote = self.remote_per_token.get(core)
        if self.local_per_token is None or remote is None or self.local_per_token <= remote:
            return None
        return rtt / (self.local_per_token - remote)
