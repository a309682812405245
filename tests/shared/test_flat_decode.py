"""FlatDecoder: pure decode steps give the model's hidden states bit for bit, on either side of the row count
where projections switch layout, and only plain Llama-family models on one rank, float32, take it."""

import pytest
import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.flat_decode import FlatDecoder
from tests.conftest import make_engine
from tests.helpers import random_hf_checkpoint, teacher_forced_decode

pytest.importorskip("transformers")

CONFIGS = {
    "llama-every-option": ("llama", {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu_new",
                                     "tie_word_embeddings": True, "head_dim": 24}),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen2-bias": ("qwen2", {}),
    "mistral-sliding-8": ("mistral", {"sliding_window": 8}),
}


def decode_steps_equal(engine, lengths: list[int], steps: int) -> int:
    """Prefill sequences of `lengths` tokens, then decode `steps` steps of all of them at once, each step's
    hidden states through the model and through the flat decoder; returns the steps compared."""
    runner = engine.runner

    def check(items):
        _, ids, pos, meta = runner.prepare(items)
        assert runner.flat.takes(meta, ids.shape[0])
        ref = engine.model(ids, pos, meta)
        _, ids, pos, meta = runner.prepare(items)
        assert torch.equal(runner.flat.forward(ids, pos, meta), ref)
    return teacher_forced_decode(engine, lengths, steps, check)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("packed_from", [1, 2, 3, 16])
def test_flat_steps_equal_the_models(tmp_path, monkeypatch, name, packed_from):
    arch, overrides = CONFIGS[name]
    path, _ = random_hf_checkpoint(tmp_path, arch, **overrides)
    # Which layout one and three rows take: 1 both packed; 2 and 3 one row input-major, three packed (3: the
    # switch itself); 16 both input-major.
    monkeypatch.setenv("EDGECORE_PACKED_FROM_ROWS", str(packed_from))
    engine = make_engine(path, block_size=4, num_blocks=64)
    assert engine.runner.flat is not None and engine.runner.flat.plain_below == packed_from
    assert decode_steps_equal(engine, [13], 12) == 12            # one row: consecutive blocks, views
    assert decode_steps_equal(engine, [5, 17, 9], 6) == 6         # rows of different lengths: gather + mask


def test_bundled_model_takes_it_and_generates_the_same(model_dir):
    engine = make_engine(model_dir)
    assert engine.runner.flat is not None
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompt = list(range(5, 60))
    flat = engine.generate([prompt], params)[0]
    engine = make_engine(model_dir)       # a fresh one: a prefix-cache hit would change the prefill's arithmetic
    engine.runner.flat = None
    plain = engine.generate([prompt], params)[0]
    assert flat["token_ids"] == plain["token_ids"] and flat["logprobs"] == plain["logprobs"]


def test_a_batch_past_the_layout_switch_generates_the_same(model_dir, monkeypatch):
    monkeypatch.setenv("EDGECORE_PACKED_FROM_ROWS", "2")          # four rows read the packed weights
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]
    flat = make_engine(model_dir).generate(prompts, params)
    engine = make_engine(model_dir)
    engine.runner.flat = None
    plain = engine.generate(prompts, params)
    assert [r["token_ids"] for r in flat] == [r["token_ids"] for r in plain]
    assert [r["logprobs"] for r in flat] == [r["logprobs"] for r in plain]


def test_only_plain_float32_llama_models_on_one_rank_take_it(tmp_path, model_dir, monkeypatch):
    path, _ = random_hf_checkpoint(tmp_path / "moe", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert make_engine(path).runner.flat is None                  # MoE layers: the model's own step
    from edgecore.shared.engine.engine import LLMEngine
    assert LLMEngine.from_dir(model_dir, "bf16", "cpu").runner.flat is None     # no input-major copies
    monkeypatch.setenv("EDGECORE_CPU_PACK", "0")
    assert make_engine(model_dir).runner.flat is None             # unpacked: F.linear on the stored layout
    engine = make_engine(model_dir)
    monkeypatch.setattr("edgecore.shared.models.flat_decode.tensor_parallel", lambda: type("TP", (), {"size": 2}))
    assert FlatDecoder.for_model(engine.model) is None
