"""The checks a new request passes before an engine admits it: token ids in the vocabulary, logit_bias keys, the
context length and the KV cache's capacity. Each failure is a `RequestError` naming the field (HTTP 400)."""

from __future__ import annotations

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError


def check_request(ids: list[int], params: SamplingParams, prefill_only: bool, vocab_size: int, max_model_len: int,
                  capacity: int) -> None:
    """`capacity`: the tokens the engine's KV cache holds."""
    vocab = vocab_size
    if not ids or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
        raise RequestError(f"the prompt must be token ids in [0, {vocab})" + ("" if ids else ": it is empty"),
                           param="prompt")
    if params.logit_bias and max(params.logit_bias) >= vocab:     # (keys are checked ≥ 0 by validate)
        raise RequestError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
    need = len(ids) + (1 if prefill_only else params.max_tokens)
    if need > max_model_len:
        raise RequestError(f"this model's maximum context length is {max_model_len} tokens, but the request "
                           f"needs {len(ids)} prompt tokens + {need - len(ids)} completion tokens",
                           param="max_tokens" if len(ids) < max_model_len else "prompt",
                           code="context_length_exceeded")
    if need > capacity:
        raise RequestError(f"the request needs {need} tokens of KV cache but the cache holds {capacity}",
                           param="prompt", code="context_length_exceeded")
