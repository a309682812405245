"""Per-request sampling parameters, validated once when a request is added.

Field names and meanings follow vLLM / OpenAI: `temperature` 0 means greedy;
`top_k` ≤ 0 disables top-k; `logprobs` is how many top alternatives to return
beside the chosen token's logprob (None: no logprobs); `detokenize=False`
returns token ids only (no text, so no stop strings either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from edgecore.shared.errors import RequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    detokenize: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> None:
        def bad(param, message):
            raise RequestError(f"'{param}' {message}", param=param)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                bad(name, f"must be a finite number, got {value!r}")
        if not 0 <= self.temperature <= 100:
            bad("temperature", f"must be between 0 and 100, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            bad("top_k", f"must be an integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 16:
            bad("stop", "must be up to 16 non-empty strings")
        if self.stop and not self.detokenize:
            bad("stop", "needs detokenized text: stop strings cannot be used with detokenize=False")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
