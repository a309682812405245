"""CompiledDecoder (`--compile`): the compiled decode step gives the eager step's logits (to float32 rounding)
for plain Llama-family models with every option the graph handles (attention and MLP biases, a non-SiLU
activation, tied embeddings, an odd head size, Qwen3's per-head norms, an LM head too large for the graph), at
one row and at every row count up to MAX_ROWS without a new graph; rows that sample nothing still write their
K/V; the bundled model generates the same tokens with it as without; and every case it does not serve
(windowed attention, other thread counts, large steps, a layer hook, a failed compile, a failed step) runs
eagerly.

Each compile takes tens of seconds on a 2-core machine (a few once torch's cache is warm): one engine per model."""

import logging

import pytest
import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.scheduler import ScheduledBatch
from edgecore.shared.engine.sequence import Sequence
from edgecore.shared.models import compiled_decode
from edgecore.shared.models.compiled_decode import MAX_ROWS, CompiledDecoder
from tests.conftest import make_engine
from tests.helpers import random_hf_checkpoint, teacher_forced_decode

pytest.importorskip("transformers")

CONFIGS = {
    "llama-every-option": ("llama", {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu_new",
                                     "tie_word_embeddings": True, "head_dim": 24}),
    # untied, 20000 x 64 float32: an LM head over KEEP_PLAIN_BYTES keeps no plain copy, so it stays out of the graph
    "qwen3-qk-norm-big-head": ("qwen3", {"attention_bias": True, "vocab_size": 20000}),
}


def compiled_engine(model_dir, **kw):
    engine = make_engine(model_dir, compile_decode=True, **kw)
    engine.compile_decode()
    assert engine.runner.compiled is not None, "the decode step did not compile"
    return engine


@pytest.fixture(scope="module")
def bundled(model_dir):
    return compiled_engine(model_dir)


def steps_match(engine, lengths: list[int], steps: int) -> None:
    """Prefill sequences of `lengths` tokens, then decode `steps` steps of all of them at once; each step's
    logits through the compiled step and through the model (same tokens in: teacher-forced)."""
    runner = engine.runner

    def check(items):
        _, ids, pos, meta = runner.prepare(items)
        assert runner.compiled.takes(meta, ids.shape[0])
        got = runner.compiled.logits(ids, pos, meta)
        _, ids, pos, meta = runner.prepare(items)
        ref = engine.model.compute_logits(engine.model(ids, pos, meta))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    teacher_forced_decode(engine, lengths, steps, check)


def widest_table_is_served(engine) -> None:
    """The longest context the graphs serve (MAX_CONTEXT positions of block table) runs without a new graph at
    one row, a few and the wide module's row counts; one block more is not taken. The dummy steps write the
    last block's first two slots: put back after."""
    compiled, bs = engine.runner.compiled, engine.pool.block_size
    widest = compiled_decode.MAX_CONTEXT // bs
    kept = [[c[(widest - 1) * bs:widest * bs].clone() for c in pair] for pair in engine.pool.layers]
    try:
        for rows in (1, 2, 10):
            _, _, meta = compiled._dummy(rows, widest + 1)
            assert not compiled.takes(meta, rows)
            with torch.inference_mode():                    # as the runner builds and runs a step
                ids, pos, meta = compiled._dummy(rows, widest)
                assert compiled.takes(meta, rows)
                assert torch.isfinite(compiled.logits(ids, pos, meta)).all()
    finally:
        for pair, old in zip(engine.pool.layers, kept):
            for c, o in zip(pair, old):
                c[(widest - 1) * bs:widest * bs].copy_(o)


@pytest.mark.slow
def test_bundled_model_logits_match(bundled):
    steps_match(bundled, [13], 8)                 # one row, crossing a block boundary
    steps_match(bundled, [3], 4)                  # one row in its first block (the table padded to two)
    steps_match(bundled, [5, 40, 17, 90], 6)      # rows of different lengths: gather + mask
    # Every row count the compiled step serves, widths 1-9 blocks: none may need a new graph (the serving
    # call raises instead of recompiling).
    for rows in range(1, MAX_ROWS + 1):
        steps_match(bundled, [(7 * i + rows) % 140 + 1 for i in range(rows)], 1)
    assert bundled.runner.compiled.graph.lm_head is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_every_option_logits_match(tmp_path, name):
    arch, overrides = CONFIGS[name]
    path, _ = random_hf_checkpoint(tmp_path, arch, **overrides)
    # block size 4: the widest table served is 1024 blocks
    engine = compiled_engine(path, block_size=4, num_blocks=1100)
    assert (engine.runner.compiled.graph.lm_head is None) == name.endswith("big-head")
    steps_match(engine, [13], 6)
    steps_match(engine, [5, 17, 9], 6)
    steps_match(engine, [3 + 4 * i for i in range(10)], 3)    # the wide module, its matmul rows padded 10 -> 12
    widest_table_is_served(engine)


@pytest.mark.slow
def test_bundled_model_generates_the_same_tokens(bundled, model_dir):
    # Different lengths and budgets: the batch shrinks from six rows to one as requests finish.
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((3, 16, 17, 40, 64, 120))]
    params = [SamplingParams(max_tokens=8 + 6 * i, temperature=0, ignore_eos=True, logprobs=2) for i in range(6)]
    steps = []
    real = bundled.runner.compiled.logits
    bundled.runner.compiled.logits = lambda *a: steps.append(a[0].shape[0]) or real(*a)
    try:
        got = [bundled.generate([p], q)[0] for p, q in zip(prompts, params)]
        for i, p in enumerate(prompts):
            bundled.add_request(str(i), p, params[i])
        out = {}
        while bundled.has_unfinished():
            for o in bundled.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        batched = [out[str(i)] for i in range(6)]
    finally:
        bundled.runner.compiled.logits = real
    assert {1, 6} <= set(steps)                   # one-row and six-row graphs both served
    eager = make_engine(model_dir)
    ref = [eager.generate([p], q)[0] for p, q in zip(prompts, params)]
    for g, b, r in zip(got, batched, ref):
        assert g["token_ids"] == r["token_ids"] == b
        for lg, lr in zip(g["logprobs"], r["logprobs"]):
            assert lg.token_id == lr.token_id and lg.logprob == pytest.approx(lr.logprob, abs=1e-4)


@pytest.mark.slow
def test_steps_it_does_not_serve_run_eagerly(bundled):
    runner = bundled.runner
    seqs = []
    for i in range(MAX_ROWS + 1):
        seq = Sequence(f"x{i}", [5 + i] * 20, SamplingParams(max_tokens=1))
        bundled.block_manager.allocate_prompt(seq.table, seq.token_ids, 20)
        seq.num_computed_tokens = 19
        seqs.append(seq)
    try:
        _, ids, _, meta = runner.prepare([(s, 1) for s in seqs[:MAX_ROWS]])
        assert runner.compiled.takes(meta, ids.shape[0])
        _, ids, _, meta = runner.prepare([(s, 1) for s in seqs])
        assert not runner.compiled.takes(meta, ids.shape[0])                  # more rows than MAX_ROWS
        _, ids, _, meta = runner.prepare([(seqs[0], 1)], on_layer=lambda layer: None)
        assert not runner.compiled.takes(meta, ids.shape[0])                  # a core's layer hook
        seqs[1].num_computed_tokens = 15
        for items in ([(seqs[1], 5)], [(seqs[0], 1), (seqs[1], 5)]):       # small chunks (drafts, short prompts):
            _, ids, _, meta = runner.prepare(items)                          # the flat decoder's, never compiled
            assert runner.flat.takes(meta, ids.shape[0]) and not runner.compiled.takes(meta, ids.shape[0])
        seqs[1].num_computed_tokens = 19
        _, ids, _, meta = runner.prepare([(seqs[0], 1)])
        before = torch.get_num_threads()
        torch.set_num_threads(before + 1)
        try:
            assert not runner.compiled.takes(meta, ids.shape[0])              # not the count it was compiled for
        finally:
            torch.set_num_threads(before)
        assert runner.compiled.takes(meta, ids.shape[0])
    finally:
        for s in seqs:
            bundled.block_manager.free_table(s.table)
    widest_table_is_served(bundled)


def test_windowed_models_and_failed_compiles_serve_eagerly(tmp_path, monkeypatch, caplog, model_dir):
    path, _ = random_hf_checkpoint(tmp_path, "mistral", sliding_window=8)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.WARNING, "edgecore.engine"):
        engine = make_engine(path, compile_decode=True)
        out = engine.generate([list(range(3, 30))], params)[0]
    assert engine.runner.compiled is None and engine.runner.flat is not None
    assert "no compiled form" in caplog.text
    assert out["token_ids"] == make_engine(path).generate([list(range(3, 30))], params)[0]["token_ids"]

    def broken(self, ids, positions, meta, compiling=False):
        for k, v in self.graph.caches:              # the dummy steps' K/V writes (the wide one's: block 7)
            k.index_fill_(0, meta.slot_mapping, 1.0)
            v.index_fill_(0, meta.slot_mapping, 1.0)
        if ids.shape[0] >= compiled_decode.WIDE_FROM:
            raise RuntimeError("no C++ compiler found")
    monkeypatch.setattr(CompiledDecoder, "logits", broken)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "edgecore.engine"):
        engine = make_engine(model_dir, compile_decode=True)
        for k, v in engine.pool.layers:               # KV written before the compile: put back as it was
            k[:128].fill_(7.0)
            v[:128].fill_(5.0)
        engine.compile_decode()
    assert engine.runner.compiled is None
    assert "compiling the decode step failed (RuntimeError: no C++ compiler found)" in caplog.text
    for k, v in engine.pool.layers:
        assert bool((k[:128] == 7.0).all()) and bool((v[:128] == 5.0).all()) and k[128:].abs().sum() == 0
    assert not compiled_decode.CompiledDecoder.supports(None)


@pytest.mark.slow
def test_rows_that_do_not_sample_still_write_their_kv(bundled):
    """One-token prompt chunks (a tight token budget makes them) are decode rows that sample nothing: the
    compiled step must still run and write their K/V as the eager model does."""
    runner, pool = bundled.runner, bundled.pool
    calls = []
    real = runner.compiled.logits
    runner.compiled.logits = lambda *a: calls.append(1) or real(*a)
    seqs = []
    try:
        for i in range(3):
            seq = Sequence(f"p{i}", [(11 * i + j) % 300 + 2 for j in range(30)], SamplingParams(max_tokens=1))
            bundled.block_manager.allocate_prompt(seq.table, seq.token_ids, 30)
            with torch.inference_mode():
                _, ids, pos, meta = runner.prepare([(seq, 10 + i)])
                bundled.model(ids, pos, meta)
            seq.num_computed_tokens = 10 + i
            seqs.append(seq)
        batch = ScheduledBatch(items=[(s, 1) for s in seqs])
        assert runner.run(batch) == ([], None) and calls == [1]
        slots = torch.tensor([pool.slots(s.table.blocks, s.num_computed_tokens, s.num_computed_tokens + 1)[0]
                              for s in seqs])
        layers = range(bundled.config.num_hidden_layers)
        got = [pool.read(layer, slots) for layer in layers]
        for layer in layers:
            for cache in pool.layers[layer]:
                cache[slots] = 0
        with torch.inference_mode():
            _, ids, pos, meta = runner.prepare(batch.items)
            bundled.model(ids, pos, meta)
        for layer, (k, v) in zip(layers, got):
            rk, rv = pool.read(layer, slots)
            assert k.abs().sum() > 0
            torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)
    finally:
        runner.compiled.logits = real
        for s in seqs:
            bundled.block_manager.free_table(s.table)


@pytest.mark.slow
def test_a_failing_compiled_step_falls_back_to_eager(bundled, model_dir, caplog):
    runner = bundled.runner
    compiled = runner.compiled

    def recompile(*args):
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")
    real, compiled.step = compiled.step, recompile
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        with caplog.at_level(logging.WARNING, "edgecore.engine"):
            got = bundled.generate([list(range(20, 60))], params)[0]
        assert runner.compiled is None
        assert "compiled decode step failed (RuntimeError: Detected recompile" in caplog.text
    finally:
        compiled.step, runner.compiled = real, compiled
    assert got["token_ids"] == make_engine(model_dir).generate([list(range(20, 60))], params)[0]["token_ids"]
