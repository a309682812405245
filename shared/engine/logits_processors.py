"""Penalties and biases on a batch's logits, before a token is chosen (vLLM semantics).

Life cycle: each step the sampler calls `adjust(logits, seqs, rows)` for the
rows whose requests ask for any of these; the result is a new logits tensor
(the raw one stays for logprobs). For those rows, all at once:
- `repetition_penalty` r over prompt and output tokens: a seen token's logit
  is divided by r when positive, multiplied by r otherwise;
- `frequency_penalty` f and `presence_penalty` p over output tokens only:
  logit -= f × count + p × (count > 0);
- `logit_bias`: logit += bias[token] (OpenAI: -100 bans a token, 100 forces it).
The token counts come from one flattened index tensor of the rows' tokens
(one scatter per step), not from a loop over requests in Python.
"""

from __future__ import annotations

from itertools import chain

import torch

from edgecore.shared.engine.sequence import Sequence


def _counts(seqs: list[Sequence], rows: list[int], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: output-token counts [R, vocab] (float) and whether a token was seen anywhere [R, vocab]."""
    lengths = torch.tensor([seqs[i].num_tokens for i in rows], device=device)
    prompt = torch.tensor([seqs[i].num_prompt_tokens for i in rows], device=device)
    flat = torch.tensor(list(chain.from_iterable(seqs[i].token_ids for i in rows)), dtype=torch.long,
                        device=device)
    row = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(flat.numel(), device=device) - torch.repeat_interleave(starts, lengths)
    output = position >= prompt[row]
    index = row * vocab + flat
    counts = torch.zeros(len(rows) * vocab, device=device)
    counts.index_add_(0, index[output], torch.ones(int(output.sum()), device=device))
    seen = torch.zeros(len(rows) * vocab, dtype=torch.bool, device=device)
    seen[index] = True
    return counts.view(len(rows), vocab), seen.view(len(rows), vocab)


def adjust(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """`logits` [S, vocab] with the penalties and biases of `rows` applied (a new tensor)."""
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype
    params = [seqs[i].params for i in rows]
    sub = logits[rows]
    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(r != 1.0 for r in rep) or any(freq) or any(pres):
        counts, seen = _counts(seqs, rows, vocab, device)
        if any(r != 1.0 for r in rep):
            r = torch.tensor(rep, dtype=dtype, device=device).unsqueeze(1)
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        if any(freq) or any(pres):
            f = torch.tensor(freq, dtype=dtype, device=device).unsqueeze(1)
            p = torch.tensor(pres, dtype=dtype, device=device).unsqueeze(1)
            sub = sub - f * counts - p * (counts > 0).to(dtype)
    biased = [(j, p.logit_bias) for j, p in enumerate(params) if p.logit_bias]
    if biased:
        bias_rows = torch.tensor([j for j, b in biased for _ in b], device=device)
        bias_ids = torch.tensor([t for _, b in biased for t in b], device=device)
        bias_vals = torch.tensor([v for _, b in biased for v in b.values()], dtype=dtype, device=device)
        keep = bias_ids < vocab
        sub = sub.index_put((bias_rows[keep], bias_ids[keep]), bias_vals[keep], accumulate=True)
    out = logits.clone()
    out[rows] = sub
    return out
