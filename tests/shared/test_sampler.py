"""Penalties, biases and min-p in the batched sampler against a per-row reference written from vLLM's rules."""

import torch

from edgecore.shared.engine.logits_processors import adjust
from edgecore.shared.engine.sampler import sample
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.sequence import Sequence


def seq(prompt, output, **kw):
    s = Sequence("r", prompt, SamplingParams(**kw))
    s.token_ids += output
    return s


def reference(row: torch.Tensor, s: Sequence) -> torch.Tensor:
    row = row.clone()
    p = s.params
    for t in set(s.token_ids):
        if p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        row[t] -= p.frequency_penalty * s.output_token_ids.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    return row


def test_adjust_matches_per_row_reference():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(5, vocab, generator=g) * 3
    seqs = [seq([1, 2, 3, 3], [4, 4, 4, 2], repetition_penalty=1.7),
            seq([5, 6], [7, 7, 8], frequency_penalty=0.6, presence_penalty=-0.4),
            seq([9], [], temperature=0),                                 # untouched row
            seq([1, 1, 2], [2, 9, 9, 9], repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0,
                logit_bias={3: -100, 4: 7.5}),
            seq([10, 11], [12], logit_bias={0: 100})]
    for rows in ([0, 1, 3, 4], [3], [1]):         # several rows with different values; one row (scalar paths)
        out = adjust(logits, seqs, rows)
        for i in range(5):
            want = reference(logits[i], seqs[i]) if i in rows else logits[i]
            torch.testing.assert_close(out[i], want)
    same = [seq([1, 2], [3, 3], repetition_penalty=1.5, presence_penalty=0.5) for _ in range(2)]
    out = adjust(logits[:2], same, [0, 1])        # every row, equal values
    for i in range(2):
        torch.testing.assert_close(out[i], reference(logits[i], same[i]))
    assert not torch.equal(out, logits)          # the raw logits stay for logprobs
    torch.testing.assert_close(logits, torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 3)


def test_sample_applies_bias_penalties_and_min_p():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]] * 4)
    seqs = [seq([0], [], temperature=0, logit_bias={0: -100}),                 # greedy token banned
            seq([0], [0, 0], temperature=0, frequency_penalty=2.0),             # 5 - 4 < 4
            seq([0], [], temperature=0, logprobs=1),
            seq([2], [], temperature=1.0, min_p=1.0, seed=5)]                  # min_p 1: only the top token
    r = sample(logits, seqs)
    assert r.token_ids == [1, 1, 0, 0]
    assert r.logprobs[0] == torch.log_softmax(logits[0], -1)[1].item()   # logprob of the raw distribution
    seeded = [seq([2], [], temperature=1.5, min_p=0.3, seed=s) for s in range(40)]
    drawn = sample(logits[:1].expand(40, 4).contiguous(), seeded).token_ids
    probs = torch.softmax(logits[0] / 1.5, -1)
    allowed = {t for t in range(4) if probs[t] >= 0.3 * probs.max()}
    assert set(drawn) <= allowed and len(set(drawn)) > 1


def test_fast_path_unchanged_without_adjustments():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    seqs = [seq([1], [2], temperature=0) for _ in range(3)]
    assert not any(s.params.adjusts_logits for s in seqs)
    assert sample(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_sampling_spec_carries_every_first_token_field():
    from edgecore.protocol import messages as m
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, logprobs=2, presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.3, logit_bias={7: -100.0}, min_p=0.2)
    wire = m.encoder.encode(m.PrefillRequest("r", [1, 2], m.SamplingSpec(**p.spec_fields())))
    spec = m.decoder.decode(wire).sampling
    back = SamplingParams.from_spec(spec, max_tokens=1)
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "min_p"):
        assert getattr(back, name) == getattr(p, name), name
    old = m.decoder.decode(m.encoder.encode(m.PrefillRequest("r", [1], m.SamplingSpec(0.5, 1.0, -1, 9))))
    plain = SamplingParams.from_spec(old.sampling, max_tokens=1)     # a peer that sends only the first fields
    assert plain.logit_bias is None and not plain.adjusts_logits and plain.seed == 9


def test_adjust_state_follows_tokens_appended_between_steps():
    """The per-request counts are kept across steps: tokens appended one by one (as decoding does) or several
    at once (a first token from a core, then decoding) give what a fresh computation gives; a finished
    sequence's row is reused without leaking its counts."""
    g = torch.Generator().manual_seed(1)
    vocab = 40
    kw = dict(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.3)
    live = [seq([1, 2, 3], [], **kw), seq([4, 5], [6], **kw)]
    for tokens in [[7, 8], [7, 9, 9], [1, 10], [7]]:
        logits = torch.randn(2, vocab, generator=g) * 3
        out = adjust(logits, live, [0, 1])
        for i in range(2):
            torch.testing.assert_close(out[i], reference(logits[i], live[i]))
        live[0].token_ids.append(tokens[0])
        live[1].token_ids += tokens[1:]
    del live
    fresh = [seq([11], [12], **kw) for _ in range(3)]        # may take the rows just freed
    logits = torch.randn(3, vocab, generator=g) * 3
    out = adjust(logits, fresh, [0, 1, 2])
    for i in range(3):
        torch.testing.assert_close(out[i], reference(logits[i], fresh[i]))


def test_a_vanishing_temperature_samples_greedily():
    """Logits divided by a temperature near float32's smallest normal overflow to inf (softmax NaN, token 0
    whatever the logits): such temperatures take the argmax, their limit."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)) * 20
    logits[:, 0] = -30.0                        # the token a NaN distribution would give
    for temperature in (1e-38, 1e-40, 1e-6):
        seqs = [seq([1], [], temperature=temperature, seed=s) for s in range(4)]
        assert all(s.params.greedy for s in seqs)
        assert sample(logits, seqs).token_ids == logits.argmax(-1).tolist()
    assert not seq([1], [], temperature=1e-4).params.greedy


def test_repetition_penalty_is_bounded_where_logits_stay_finite():
    """A penalty so small that 1/r overflows float32 would turn logits to inf/NaN (and failed the whole step):
    it is refused; the smallest and largest accepted ones keep every logit finite."""
    import pytest

    from edgecore.shared.errors import RequestError
    for bad in (0.0, 1e-300, 1e-38, 0.009, 101.0):
        with pytest.raises(RequestError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad).validate()
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 30
    seqs = [seq([1, 2, 3], [4, 5], repetition_penalty=0.01), seq([1, 2, 3], [4, 5], repetition_penalty=100.0)]
    assert torch.isfinite(adjust(logits, seqs, [0, 1])).all()


def test_logit_bias_outside_the_vocabulary_is_refused_by_the_engine():
    """The HTTP layer checks it, but a protocol peer's sampling spec reaches the engine directly."""
    import pytest

    from edgecore.shared.errors import RequestError
    from tests.conftest import make_engine
    engine = make_engine(num_blocks=16)
    vocab = engine.config.vocab_size
    with pytest.raises(RequestError) as e:
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=2, logit_bias={vocab + 10 ** 9: 1.0}))
    assert e.value.param == "logit_bias"
    engine.add_request("ok", [5, 6], SamplingParams(max_tokens=2, logit_bias={vocab - 1: 1.0}))
