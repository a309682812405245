"""Per-request output processing: stop conditions, detokenization, deltas.

Life cycle: the engine creates one `OutputState` per request. For every
sampled token it calls `push(token, logprob, top)`, which appends to the
sequence, decides whether the request stops (stop token / EOS, a completed grammar,
stop string, max_tokens, context length), and returns the text that can be shown now.
Text that might still become the start of a stop string is held back until
it cannot (or the request ends), so a streamed stop string never leaks. The
first output carries the prompt logprobs when the request asked for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgecore.shared.engine.grammar import advance
from edgecore.shared.engine.sequence import Sequence
from edgecore.shared.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 0                          # 1 = the most likely token (prompt logprobs only; 0: not computed)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None   # first output only, when asked for

    @staticmethod
    def joined(outs: list[RequestOutput]) -> RequestOutput:
        """Consecutive outputs of one request as one (the tokens a speculative step accepted: one output per
        step, as for any step, so streams and inter-token metrics see steps, not drafts)."""
        if len(outs) == 1:
            return outs[0]
        first, last = outs[0], outs[-1]
        lps = [lp for o in outs for lp in o.logprobs or ()] if any(o.logprobs for o in outs) else None
        return RequestOutput(first.request_id, [t for o in outs for t in o.new_token_ids],
                             "".join(o.new_text for o in outs), last.finished, last.finish_reason, lps,
                             last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens,
                             first.prompt_logprobs)


class OutputState:
    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None, eos_ids: tuple[int, ...],
                 max_model_len: int):
        self.seq = seq
        params = seq.params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.stops = params.stop
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.detok = IncrementalDetokenizer(tokenizer, seq.token_ids) if tokenizer and params.detokenize else None
        self.text = ""
        self.emitted = 0
        self.max_model_len = max_model_len
        # Prompt tokens not recomputed, as the node that prefilled the request counted them (its prefix cache);
        # None: this engine's own count (`seq.num_cached_tokens`).
        self.reported_cached: int | None = None

    def push(self, token: int, logprob: float | None = None, top: list[tuple[int, float]] | None = None
             ) -> RequestOutput:
        seq, params = self.seq, self.seq.params
        seq.token_ids.append(token)
        reason = None
        if token in self.stop_ids:
            reason = "stop"
        elif seq.grammar is not None and advance(seq.grammar, token):
            reason = "stop"           # the grammar is complete: nothing else may follow
            if self.detok is not None:
                self._append_text(self.detok.push(token) + self.detok.flush())
        elif self.detok is not None:
            delta = self.detok.push(token)
            if delta:
                reason = self._append_text(delta)
        if reason is None:
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None and reason != "stop" and self.detok is not None:
            tail = self.detok.flush()
            if tail:
                reason = self._append_text(tail) or reason
        lps = None
        if logprob is not None:
            lps = [TokenLogprob(token, logprob, top or [])]
        out = self._output([token], reason, lps)
        if seq.num_output_tokens == 1 and params.prompt_logprobs is not None:
            out.prompt_logprobs = seq.prompt_logprobs
        return out

    def _append_text(self, delta: str) -> str | None:
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        for stop in self.stops:
            idx = self.text.find(stop, start)
            if idx >= 0:
                end = idx + len(stop) if self.seq.params.include_stop_str_in_output else idx
                self.text = self.text[:end]
                return "stop"
        return None

    def _output(self, tokens: list[int], reason: str | None, lps: list[TokenLogprob] | None) -> RequestOutput:
        finished = reason is not None
        limit = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        new_text = self.text[self.emitted:limit]
        self.emitted = limit
        seq = self.seq
        return RequestOutput(seq.request_id, tokens, new_text, finished, reason, lps,
                             seq.num_prompt_tokens,
                             seq.num_cached_tokens if self.reported_cached is None else self.reported_cached,
                             seq.num_output_tokens)

    def abort_output(self) -> RequestOutput:
        return self._output([], "abort", None)
