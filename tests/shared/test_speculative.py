"""Speculative decoding by prompt lookup (shared/engine/speculative.py): drafts verified in one step emit exactly
what plain decoding emits (greedy, and seeded sampling), whatever the drafts, through stops, preemption and the
prefix cache; the verification rule keeps the model's distribution (a chi-squared test on a small vocabulary)."""

import numpy as np
import pytest
import torch

from tests.conftest import make_engine
from edgecore.shared.engine import speculative
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.speculative import PROBE_TOKENS, lookup, verify
from edgecore.shared.models.config import SpeculativeConfig

CODE = '''def schedule(self):
    batch = ScheduledBatch()
    budget = self.config.max_num_batched_tokens
    for seq in self.running:
        need = seq.num_tokens - seq.num_computed_tokens
        batch.items.append((seq, need))
    return batch
'''
PROMPTS = [CODE + "\n# The same function, unchanged:\n" + CODE[:120], "Hello world. Hello world. Hello",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "The quick brown fox jumps over the lazy dog."]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def tokens(results):
    return [r["token_ids"] for r in results]


def test_lookup_takes_the_longest_suffix_that_occurred_before_and_its_latest_occurrence():
    t = np.array([5, 1, 2, 3, 9, 7, 2, 3, 4, 8, 1, 2, 3])
    assert lookup(t, 3, n_max=3, n_min=1) == [9, 7, 2]       # [1, 2, 3] at 1 (not [2, 3] at 6, which is later)
    assert lookup(t, 3, n_max=2, n_min=1) == [4, 8, 1]       # [2, 3]: its latest occurrence, at 6
    assert lookup(np.array([1, 2, 3, 4]), 3, 3, 1) == []      # nothing repeats
    assert lookup(np.array([4, 4]), 3, 3, 1) == [4]           # the continuation stops at the end
    assert lookup(np.array([7]), 3, 3, 1) == []


@pytest.fixture(scope="module")
def plain():
    engine = make_engine(block_size=4)
    greedy = tokens(engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40)))
    cached = set(engine.block_manager.cached)
    return {"greedy": greedy, "cached": cached,
            "seeded": tokens(engine.generate(PROMPTS, SamplingParams(temperature=0.9, top_p=0.95, seed=11,
                                                                     max_tokens=40)))}


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_prompt_lookup_emits_what_plain_decoding_emits(plain, mode):
    engine = make_engine(block_size=4, speculative=SPEC)
    params = (SamplingParams(temperature=0, max_tokens=40) if mode == "greedy" else
              SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40))
    assert tokens(engine.generate(PROMPTS, params)) == plain[mode]
    stats = engine.stats()
    assert stats.spec_drafts > 0 and stats.spec_draft_tokens >= stats.spec_drafts
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens


@pytest.fixture
def oracle(monkeypatch, plain):
    """Drafts from the plain run's own continuation, every `wrong`-th drafted token replaced: many tokens are
    accepted per step, and rejections come at every offset."""
    futures = {}

    def install(engine, mode, wrong):
        for p, out in zip(PROMPTS, plain[mode]):
            ids = engine.tokenizer.encode(p)
            futures[tuple(ids[-8:])] = (len(ids), out)
        counter = iter(range(10**6))

        def lookup_oracle(t, k, n_max, n_min):
            for tail, (n, out) in futures.items():
                done = len(t) - n
                if done >= 0 and tuple(t[n - 8:n].tolist()) == tail:
                    draft = list(out[done:done + k])
                    return [d if (next(counter) + 1) % wrong else d ^ 1 for d in draft]
            return []
        monkeypatch.setattr(speculative, "lookup", lookup_oracle)
    return install


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("wrong", [10**9, 3])
def test_many_tokens_accepted_per_step_and_rejections_anywhere_change_nothing(plain, oracle, mode, wrong):
    engine = make_engine(block_size=4, speculative=SPEC)
    oracle(engine, mode, wrong)
    params = (SamplingParams(temperature=0, max_tokens=40) if mode == "greedy" else
              SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40))
    assert tokens(engine.generate(PROMPTS, params)) == plain[mode]
    stats = engine.stats()
    if wrong > 100:
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 2 * stats.spec_drafts   # all accepted
    else:
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    if mode == "greedy":   # rejected drafts' KV is never cached: the same blocks as plain decoding's
        assert set(engine.block_manager.cached) == plain["cached"]


def test_stops_and_max_tokens_inside_a_draft(plain, oracle):
    engine = make_engine(block_size=4, speculative=SPEC)
    oracle(engine, "greedy", 10**9)
    ref = make_engine(block_size=4)
    text = ref.tokenizer.decode(plain["greedy"][0][:14])
    for params in (SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0, max_tokens=40,
                                                                                  stop=[text[-3:]])):
        got, want = engine.generate(PROMPTS, params), ref.generate(PROMPTS, params)
        assert tokens(got) == tokens(want)
        assert [r["text"] for r in got] == [r["text"] for r in want]
    assert [len(t) for t in tokens(engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7)))] == [
        min(7, len(t)) for t in plain["greedy"]]


def test_preemption_with_drafts_in_flight(plain, oracle):
    """A pool too small for every sequence: drafts never preempt, and a preempted sequence loses its draft."""
    engine = make_engine(block_size=4, num_blocks=56, speculative=SPEC)
    oracle(engine, "greedy", 4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = make_engine(block_size=4, num_blocks=56)
    assert tokens(engine.generate(PROMPTS, params)) == tokens(ref.generate(PROMPTS, params))
    assert engine.scheduler.num_preemptions > 0


def test_drafting_pauses_for_a_sequence_whose_drafts_are_rejected(monkeypatch):
    monkeypatch.setattr(speculative, "lookup", lambda t, k, n_max, n_min: [int(t[-1]) ^ 1] * k)   # never right
    engine = make_engine(speculative=SPEC)
    engine.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=120))
    stats = engine.stats()
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens // 4
    assert PROBE_TOKENS <= stats.spec_draft_tokens <= 2 * (PROBE_TOKENS + SPEC.num_speculative_tokens)


def test_requests_whose_sampling_needs_each_token_do_not_draft():
    engine = make_engine(speculative=SPEC)
    for params in (SamplingParams(temperature=0, max_tokens=24, logprobs=2),
                   SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)):
        engine.generate(PROMPTS[:2], params)
    assert engine.stats().spec_drafts == 0


def chi2(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_the_verification_keeps_the_models_distribution():
    """The first emitted token after a one-token draft is distributed as p (temperature 1), whether the draft is
    likely or not; a rule that accepted every draft would fail the same test."""
    torch.manual_seed(0)
    vocab, trials = 5, 5000
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, -1.0], [0.0, 0.3, 0.1, -0.2, 0.4]])
    p = logits[0].softmax(-1).numpy()
    seq = make_seq()
    for draft in (0, 2):
        counts = np.zeros(vocab)
        for _ in range(trials):
            counts[verify(logits, [draft], seq)[0]] += 1
        assert chi2(counts, p) < 18.47            # chi-squared, 4 degrees of freedom, p = 0.001
    accept_all = np.zeros(vocab)
    accept_all[2] = trials
    assert chi2(accept_all, p) > 18.47


def make_seq():
    from edgecore.shared.engine.sequence import Sequence
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=8))
    seq.token_ids.append(4)             # the draft, as verification sees it
    return seq


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_drafts_after_a_decode_handover(plain, oracle, mode):
    """Disaggregated: the prompt's KV from a core, the core's first tokens pushed, then the edge takes over and
    drafts (prompt lookup needs no state from the core): the continuation is the single node's."""
    from tests.shared.test_handover_engine import prefill_kv
    engine = make_engine(block_size=4, speculative=SPEC)
    oracle(engine, mode, 3)
    params = (SamplingParams(temperature=0, max_tokens=40) if mode == "greedy" else
              SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40))
    prompt = engine.tokenizer.encode(PROMPTS[1])
    ref = plain[mode][1]
    engine.reserve("h", prompt, params)
    for piece in prefill_kv(prompt, params):
        engine.write_kv("h", piece)
    for token in ref[:3]:
        engine.push_token("h", token)
    engine.take_over("h", len(prompt))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == ref        # (the pushed tokens' outputs first)
    assert engine.stats().spec_accepted_tokens > 0 and engine.stats().blocks_used == 0


def test_the_speculative_config_flag_is_checked():
    from edgecore.shared.errors import ConfigError
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 6}') == SpeculativeConfig(
        num_speculative_tokens=6)
    for bad, said in (("[1]", "JSON object"), ('{"method": "eagle"}', "not supported"),
                      ('{"num_speculative_tokens": 0}', "integers"), ('{"prompt_lookup_min": 5}', "<="),
                      ('{"draft_tokens": 3}', "unknown keys"), ('{"min_acceptance": 2}', "min_acceptance")):
        with pytest.raises(ConfigError, match=said):
            SpeculativeConfig.parse(bad)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A draft model built from the bundled one: its first two layers, its embeddings and final norm."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.conftest import MODEL_DIR
    out = tmp_path_factory.mktemp("draft")
    weights = load_file(str(MODEL_DIR / "model.safetensors"))
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    save_file(keep, str(out / "model.safetensors"))
    config = json.loads((MODEL_DIR / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, out / name)
    return out


def draft_spec(path, k=4):
    return SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=k)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("draft", ["truncated", "same"])
def test_a_draft_model_emits_what_plain_decoding_emits(plain, draft_dir, mode, draft):
    """A draft of the target's first two layers (mostly rejected), and the target itself as its own draft
    (greedy: every draft accepted)."""
    from tests.conftest import MODEL_DIR
    engine = make_engine(block_size=4, speculative=draft_spec(draft_dir if draft == "truncated" else MODEL_DIR))
    params = (SamplingParams(temperature=0, max_tokens=40) if mode == "greedy" else
              SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40))
    assert tokens(engine.generate(PROMPTS, params)) == plain[mode]
    stats = engine.stats()
    assert stats.spec_drafts > 0 and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    if mode == "greedy":
        assert set(engine.block_manager.cached) == plain["cached"]
        if draft == "same":   # (a step's rows round differently in batches of other sizes: rare near-ties)
            assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens


def test_a_draft_model_under_preemption():
    from tests.conftest import MODEL_DIR
    engine = make_engine(block_size=4, num_blocks=56, speculative=draft_spec(MODEL_DIR))
    ref = make_engine(block_size=4, num_blocks=56)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert tokens(engine.generate(PROMPTS, params)) == tokens(ref.generate(PROMPTS, params))
    assert engine.scheduler.num_preemptions > 0 and engine.stats().spec_accepted_tokens > 0


def test_a_draft_model_computes_its_own_prompt_kv_after_a_handover(plain, draft_dir):
    """No draft KV crosses the link: the target's KV comes from a core, the draft model computes the prompt
    itself at its first draft."""
    from tests.conftest import MODEL_DIR
    from tests.shared.test_handover_engine import prefill_kv
    engine = make_engine(block_size=4, speculative=draft_spec(MODEL_DIR))
    params = SamplingParams(temperature=0, max_tokens=40)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    engine.reserve("h", prompt, params)
    for piece in prefill_kv(prompt, params):
        engine.write_kv("h", piece)
    assert engine.get("h").draft_stats.draft_kv == len(prompt)      # computed while the KV arrived
    engine.push_token("h", plain["greedy"][1][0])
    engine.take_over("h", len(prompt))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == plain["greedy"][1]
    stats = engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0     # its own draft: its prompt KV is right


def test_a_draft_model_must_share_the_vocabulary(draft_dir, tmp_path):
    import json
    import shutil

    from edgecore.shared.errors import ConfigError
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(draft_dir / name, tmp_path / name)
    config = json.loads((draft_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    with pytest.raises(ConfigError, match="vocabulary"):
        make_engine(speculative=draft_spec(tmp_path))
    assert SpeculativeConfig.parse(None, str(draft_dir)) == SpeculativeConfig(method="draft_model",
                                                                                model=str(draft_dir))
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}', "d") == SpeculativeConfig(
        method="draft_model", model="d", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="needs `model`"):
        SpeculativeConfig.parse('{"method": "draft_model"}')


def test_a_step_that_accepts_drafts_gives_one_output_of_several_tokens(plain, oracle):
    engine = make_engine(block_size=4, speculative=SPEC)
    oracle(engine, "greedy", 10**9)
    engine.add_request("one", PROMPTS[1], SamplingParams(temperature=0, max_tokens=40))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == plain["greedy"][1]
    assert max(len(o.new_token_ids) for o in outs) == SPEC.num_speculative_tokens + 1 and len(outs) < 15
    assert "".join(o.new_text for o in outs) == engine.tokenizer.decode(plain["greedy"][1])
    assert [o.num_output_tokens for o in outs] == sorted({o.num_output_tokens for o in outs})
