"""Token sampling for a batch of rows, each with its own parameters.

Life cycle: per step, the engine passes the logits of the rows that sample
(float32 [S, vocab]) and their sequences. Rows with penalties or biases get
them first (`logits_processors.adjust`: tensor operations over those rows,
vLLM semantics), then rows with a grammar get its token mask (`grammar.py`). Greedy rows then take the argmax; the others apply
temperature, top-k, top-p and min-p, then draw with the exponential-race trick
(argmax of p / E, E ~ Exp(1)), where a seeded request draws E from a generator
seeded by (seed, position): its tokens depend neither on what else is in the
batch nor on where or when they are sampled (a core that decoded the first
tokens, an edge that took over, a recompute after preemption all agree). Logprobs
are those of the model's raw distribution (before penalties, as vLLM returns
by default). A batch without penalties, biases or sampling rows costs one
argmax: the fast path checks only per-row flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgecore.shared.engine.grammar import apply_masks
from edgecore.shared.engine.logits_processors import adjust
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None            # chosen tokens' logprobs (None if no row asked)
    top: list[list[tuple[int, float]]] | None  # per row: top-N (token, logprob)
    # sequences that drafted (speculative.py): row → the tokens it emits this step (accepted drafts, then one)
    drafted: dict[int, list[int]] = field(default_factory=dict)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k / top-p set with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.softmax(-1)
    drop |= (probs.cumsum(-1) - probs) > top_p.unsqueeze(1)    # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _draw(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """Random tokens for the sampling `rows` of `logits` (already penalized)."""
    vocab = logits.shape[-1]
    probs = _probs(logits[rows], [seqs[i].params for i in rows])
    noise = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(rows) if seqs[i].params.seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), vocab, device=probs.device).exponential_()
    for j, i in enumerate(rows):
        seed = seqs[i].params.seed
        if seed is not None:
            gen = torch.Generator(device=probs.device).manual_seed(position_seed(seed, seqs[i].num_output_tokens))
            noise[j].exponential_(generator=gen)
    return (probs / noise).argmax(-1)


def draw_rows(logits: torch.Tensor, params: SamplingParams, first_position: int) -> torch.Tensor:
    """One request's tokens drawn from consecutive rows as `sample` would draw each (row r at output position
    `first_position + r`): speculative decoding's verification (speculative.py)."""
    probs = _probs(logits, [params] * logits.shape[0])
    noise = torch.empty_like(probs)
    seed = params.seed
    if seed is None:
        noise.exponential_()
    else:
        for r in range(logits.shape[0]):
            gen = torch.Generator(device=probs.device).manual_seed(position_seed(seed, first_position + r))
            noise[r].exponential_(generator=gen)
    return (probs / noise).argmax(-1)


def _probs(sub: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's probabilities after temperature, top-k, top-p, then min-p (min-p's dropped mass not
    renormalized)."""
    vocab = sub.shape[-1]
    temp = torch.tensor([p.temperature for p in params], dtype=sub.dtype, device=sub.device)
    sub = sub / temp.unsqueeze(1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=sub.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=sub.dtype, device=sub.device)
    if (top_k < vocab).any() or (top_p < 1).any():
        sub = _filter(sub, top_k, top_p)
    probs = sub.softmax(-1)
    min_p = [p.min_p for p in params]
    if any(min_p):      # drop tokens below min_p × the row's top probability
        floor = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
        probs = probs.masked_fill(probs < floor * probs.amax(-1, keepdim=True), 0.0)
    return probs


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position `position` of a request seeded with `seed` (a 64-bit mix, so
    neighbouring seeds and positions give unrelated streams)."""
    x = (seed % 2**64) ^ ((position + 1) * 0x9E3779B97F4A7C15 % 2**64)
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB % 2**64
    return (x ^ (x >> 31)) % 2**63


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    raw = logits
    adjusted = [i for i, s in enumerate(seqs) if s.params.adjusts_logits]
    if adjusted:
        logits = adjust(logits, seqs, adjusted)
    matchers = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
    if matchers:
        logits = apply_masks(logits, [g for _, g in matchers], [i for i, _ in matchers])
    tokens = logits.argmax(-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        tokens[rows] = _draw(logits, seqs, rows)
    token_list = tokens.tolist()
    want = [s.params.logprobs for s in seqs]
    if all(w is None for w in want):
        return SampleResult(token_list, None, None)
    logp = raw.log_softmax(-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    k = max(w or 0 for w in want)
    top: list[list[tuple[int, float]]] = [[] for _ in seqs]
    if k:
        top_values, top_ids = logp.topk(k, dim=-1)
        values, ids = top_values.tolist(), top_ids.tolist()
        for i, w in enumerate(want):
            if w:
                top[i] = list(zip(ids[i][:w], values[i][:w]))
    return SampleResult(token_list, chosen, top)
