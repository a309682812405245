"""Penalties and biases on a batch's logits, before a token is chosen (vLLM semantics).

Life cycle: each step the sampler calls `adjust(logits, seqs, rows)` for the
rows whose requests ask for any of these; the result is a new logits tensor
(the raw one stays for logprobs). For those rows, all at once:
- `repetition_penalty` r over prompt and output tokens: a seen token's logit
  is divided by r when positive, multiplied by r otherwise;
- `frequency_penalty` f and `presence_penalty` p over output tokens only:
  logit -= f × count + p × (count > 0);
- `logit_bias`: logit += bias[token] (OpenAI: -100 bans a token, 100 forces it).
What never changes for a request (its distinct prompt tokens, its bias as
tensors) is built once, on first use, and kept beside the sequence (weakly:
it goes with the sequence). Per step, the rows' output tokens are flattened
once, and each kind of adjustment is a few tensor operations over all rows,
not a loop over requests.
"""

from __future__ import annotations

import weakref
from array import array
from itertools import chain

import torch

from edgecore.shared.engine.sequence import Sequence


class _Fixed:
    """A request's per-request tensors: distinct prompt tokens, logit_bias ids and values."""

    def __init__(self, seq: Sequence, vocab: int, dtype, device):
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        self.prompt = torch.tensor(sorted(set(prompt)), dtype=torch.long, device=device)
        bias = {t: v for t, v in (seq.params.logit_bias or {}).items() if t < vocab}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.bias_vals = torch.tensor(list(bias.values()), dtype=dtype, device=device)


_fixed: weakref.WeakKeyDictionary[Sequence, _Fixed] = weakref.WeakKeyDictionary()


def _fixed_of(seqs: list[Sequence], rows: list[int], vocab: int, dtype, device) -> list[_Fixed]:
    out = []
    for i in rows:
        fixed = _fixed.get(seqs[i])
        if fixed is None:
            fixed = _fixed[seqs[i]] = _Fixed(seqs[i], vocab, dtype, device)
        out.append(fixed)
    return out


def _flat_index(parts: list[torch.Tensor], vocab: int, device) -> torch.Tensor:
    """Row-major indices into a flattened [R, vocab] tensor of the per-row token tensors `parts`."""
    if len(parts) == 1:
        return parts[0]
    lengths = torch.tensor([len(p) for p in parts], device=device)
    rows = torch.repeat_interleave(torch.arange(len(parts), device=device), lengths)
    return rows * vocab + torch.cat(parts)


def _column(values: list[float], dtype, device):
    """Per-row values as an [R, 1] tensor, or one Python number when every row has the same."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _output_counts(seqs: list[Sequence], rows: list[int], vocab: int, device) -> torch.Tensor:
    """[R, vocab] how often each token appears in each row's output (int64)."""
    outputs = [seqs[i].output_token_ids for i in rows]
    buffer = array("q", chain.from_iterable(outputs))      # one C-level pass over the rows' tokens
    flat = torch.frombuffer(buffer, dtype=torch.long) if buffer else torch.empty(0, dtype=torch.long)
    if len(rows) == 1:
        index = flat.to(device)
    else:
        lengths = torch.tensor([len(o) for o in outputs])
        row_ids = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        index = (row_ids * vocab + flat).to(device)
    return torch.bincount(index, minlength=len(rows) * vocab).view(len(rows), vocab)


def adjust(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """`logits` [S, vocab] with the penalties and biases of `rows` applied (a new tensor)."""
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype
    params = [seqs[i].params for i in rows]
    every = len(rows) == logits.shape[0]
    sub = logits.clone() if every else logits[rows]
    fixed = _fixed_of(seqs, rows, vocab, dtype, device)
    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    counts: torch.Tensor | None = None               # output-token counts, built once if a penalty needs them
    if any(r != 1.0 for r in rep):                   # over prompt and output tokens
        counts = _output_counts(seqs, rows, vocab, device)
        seen = (counts > 0).view(-1)
        seen[_flat_index([f.prompt for f in fixed], vocab, device)] = True
        r = _column(rep, dtype, device)
        scale = torch.where(sub > 0, 1.0 / r, r)
        sub *= torch.where(seen.view(len(rows), vocab), scale, 1.0)
    if any(freq) or any(pres):                        # over output tokens only
        if counts is None:
            counts = _output_counts(seqs, rows, vocab, device)
        f, p = _column(freq, dtype, device), _column(pres, dtype, device)
        penalty = counts.to(dtype) * f
        penalty += (counts > 0) * p
        sub -= penalty
    if any(p.logit_bias for p in params):            # rows without a bias hold empty tensors
        index = _flat_index([f.bias_ids for f in fixed], vocab, device)
        sub.view(-1).index_add_(0, index, torch.cat([f.bias_vals for f in fixed]))
    if every:
        return sub
    out = logits.clone()
    out[rows] = sub
    return out
