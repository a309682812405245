"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

Life cycle: a request with `prompt_logprobs` (vLLM's extra; OpenAI's `echo`
with `logprobs`) is admitted without the prefix cache (every prompt position
must be computed here). In each step that computes part of its prompt, the
model runner calls `record(model, hidden, ordered)`, which turns that chunk's
hidden states into logits and stores, for every prompt position p > 0, the
logprob of token p, its rank and the top-N alternatives in
`seq.prompt_logprobs` (position 0 has none: nothing precedes it). A chunk
computed again after preemption writes the same values again. The first
output of the request carries the list (`OutputState`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgecore.shared.engine.output import TokenLogprob
from edgecore.shared.engine.sequence import Sequence

if TYPE_CHECKING:
    from edgecore.shared.models.llama import LlamaForCausalLM


def wanted(ordered: list[tuple[Sequence, int]]) -> bool:
    return any(seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens - 1
               for seq, _ in ordered)


def record(model: LlamaForCausalLM, hidden: torch.Tensor, ordered: list[tuple[Sequence, int]]) -> None:
    offset = 0
    for seq, n in ordered:
        k, start = seq.params.prompt_logprobs, seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens - 1)    # last row whose next token is still a prompt token
        if k is not None and end > start:
            _chunk(model, hidden[offset:offset + end - start], seq, start, end, k)
        offset += n


def _chunk(model: LlamaForCausalLM, hidden: torch.Tensor, seq: Sequence, start: int, end: int, k: int) -> None:
    logp = model.compute_logits(hidden).float().log_softmax(-1)
    targets = torch.tensor(seq.token_ids[start + 1:end + 1], dtype=torch.long, device=logp.device)
    picked = logp.gather(1, targets.unsqueeze(1))
    ranks = ((logp > picked).sum(-1) + 1).tolist()
    chosen = picked.squeeze(1).tolist()
    if k:
        values, ids = logp.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in chosen]
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None] * seq.num_prompt_tokens
    for j, token in enumerate(seq.token_ids[start + 1:end + 1]):
        seq.prompt_logprobs[start + 1 + j] = TokenLogprob(token, chosen[j], tops[j], ranks[j])
