"""Penalties and biases on a batch's logits, before a token is chosen (vLLM semantics).

Life cycle: each step the sampler calls `adjust(logits, seqs, rows)` for the
rows whose requests ask for any of these; the result is a new logits tensor
(the raw one stays for logprobs). For those rows, all at once:
- `repetition_penalty` r over prompt and output tokens: a seen token's logit
  is divided by r when positive, multiplied by r otherwise;
- `frequency_penalty` f and `presence_penalty` p over output tokens only:
  logit -= f × count + p × (count > 0);
- `logit_bias`: logit += bias[token] (OpenAI: -100 bans a token, 100 forces it).
Each request keeps a row of persistent state (`_Rows`: output-token counts
and the tokens seen in prompt or output), filled with its prompt on first use
and then updated incrementally: per step only the tokens appended since the
last step are added, for all rows in one indexed add (rebuilding the counts
from every output token each step cost up to 15% of decode throughput). Its
logit_bias tensors are built once too. The state is kept beside the sequence
(weakly: its row is reused when the sequence goes). Each kind of adjustment
is then a few tensor operations over all rows, not a loop over requests.
"""

from __future__ import annotations

import weakref

import torch

from edgecore.shared.engine.sequence import Sequence


class _Rows:
    """Per-request token state kept across steps, one row per request in two tensors: `counts` [rows, vocab]
    (how often each token appears in the output) and `seen` [rows, vocab] (in the prompt or the output). A
    request's row is filled with its prompt on first use; afterwards each step adds only the tokens appended
    since the last (normally one), for all rows in one indexed add. Rows are reused once their sequence is
    gone."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.free: list[int] = []

    def take(self, seq: Sequence) -> int:
        if not self.free:
            old = self.counts.shape[0]
            grow = max(8, old)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(grow, self.vocab)])
            self.free = list(range(old + grow - 1, old - 1, -1))
        row = self.free.pop()
        self.counts[row].zero_()
        self.seen[row].zero_()
        prompt = [t for t in seq.token_ids[:seq.num_prompt_tokens] if t < self.vocab]
        self.seen[row, torch.tensor(prompt, dtype=torch.long, device=self.device)] = True
        weakref.finalize(seq, self.free.append, row)       # the row returns when the sequence goes
        return row


class _Fixed:
    """A request's per-request state: its row in `_Rows`, how many output tokens that row holds, and its
    logit_bias ids and values as tensors."""

    def __init__(self, seq: Sequence, rows: _Rows, dtype: torch.dtype, device: torch.device):
        self.rows = rows
        self.row = rows.take(seq)
        self.counted = 0
        bias = {t: v for t, v in (seq.params.logit_bias or {}).items() if t < rows.vocab}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.bias_vals = torch.tensor(list(bias.values()), dtype=dtype, device=device)


_fixed: weakref.WeakKeyDictionary[Sequence, _Fixed] = weakref.WeakKeyDictionary()
_rows: dict[tuple[int, str], _Rows] = {}


def _state(seqs: list[Sequence], rows: list[int], vocab: int, dtype: torch.dtype, device: torch.device
           ) -> tuple[_Rows, list[_Fixed]]:
    """The rows' state, brought up to date with the tokens appended since the last step (one indexed add)."""
    store = _rows.get((vocab, str(device)))
    if store is None:
        store = _rows[(vocab, str(device))] = _Rows(vocab, device)
    out, at, new = [], [], []
    for i in rows:
        seq = seqs[i]
        fixed = _fixed.get(seq)
        if fixed is None or fixed.rows is not store:
            fixed = _fixed[seq] = _Fixed(seq, store, dtype, device)
        n = seq.num_output_tokens
        if n > fixed.counted:
            added = seq.token_ids[seq.num_prompt_tokens + fixed.counted:]
            new.extend(added)
            at.extend([fixed.row] * len(added))
            fixed.counted = n
        out.append(fixed)
    if new:
        index = (torch.tensor(at, dtype=torch.long, device=device), torch.tensor(new, dtype=torch.long, device=device))
        store.counts.index_put_(index, torch.ones(len(new), dtype=torch.int32, device=device), accumulate=True)
        store.seen[index] = True
    return store, out


def _flat_index(parts: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """Row-major indices into a flattened [R, vocab] tensor of the per-row token tensors `parts`."""
    if len(parts) == 1:
        return parts[0]
    lengths = torch.tensor([len(p) for p in parts], device=device)
    rows = torch.repeat_interleave(torch.arange(len(parts), device=device), lengths)
    return rows * vocab + torch.cat(parts)


def _column(values: list[float], dtype: torch.dtype, device: torch.device) -> float | torch.Tensor:
    """Per-row values as an [R, 1] tensor, or one Python number when every row has the same."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def adjust(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """`logits` [S, vocab] with the penalties and biases of `rows` applied (a new tensor)."""
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype
    params = [seqs[i].params for i in rows]
    every = len(rows) == logits.shape[0]
    sub = logits.clone() if every else logits[rows]
    store, fixed = _state(seqs, rows, vocab, dtype, device)
    index = torch.tensor([f.row for f in fixed], dtype=torch.long, device=device)
    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(r != 1.0 for r in rep):                   # over prompt and output tokens
        r = _column(rep, dtype, device)
        scale = torch.where(sub > 0, 1.0 / r, r)
        sub *= torch.where(store.seen[index], scale, 1.0)
    if any(freq) or any(pres):                        # over output tokens only
        counts = store.counts[index]
        f, p = _column(freq, dtype, device), _column(pres, dtype, device)
        penalty = counts.to(dtype) * f
        penalty += (counts > 0) * p
        sub -= penalty
    if any(p.logit_bias for p in params):            # rows without a bias hold empty tensors
        flat = _flat_index([f.bias_ids for f in fixed], vocab, device)
        sub.view(-1).index_add_(0, flat, torch.cat([f.bias_vals for f in fixed]))
    if every:
        return sub
    out = logits.clone()
    out[rows] = sub
    return out
