"""Speculative decoding and the quantized KV pool on every family's tiny random checkpoint (the bundled model
is one Llama): drafts verified in chunks through each family's attention (sliding windows that release blocks,
learned sinks, chunked attention, MoE routing, MLA's latent cache) emit what plain decoding emits; an int8 pool
serves each per-head family."""

import pytest
import torch

from edgecore.shared.engine import speculative
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.config import SpeculativeConfig
from tests.conftest import make_engine
from tests.helpers import random_hf_checkpoint

pytestmark = pytest.mark.timeout(300)

DENSE = {"llama-every-option": ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 24,
                                          "tie_word_embeddings": True, "num_key_value_heads": 1}),
         "mistral-sliding-8": ("mistral", {"sliding_window": 8}),
         "qwen3-qk-norm": ("qwen3", {"head_dim": 24})}
MOE = ("mixtral-sliding", "gpt_oss", "llama4", "qwen3_moe")
MLA = ("v3-qlora-yarn-grouped",)


def checkpoint(tmp_path, name):
    if name in DENSE:
        arch, overrides = DENSE[name]
        return random_hf_checkpoint(tmp_path, arch, **overrides)[0]
    if name in MOE:
        from tests.shared.moe_checkpoints import build
        return build(tmp_path, name)[0]
    from tests.shared.deepseek_checkpoints import deepseek_checkpoint
    return deepseek_checkpoint(tmp_path / name, name)[0]


@pytest.mark.parametrize("name", [*DENSE, *MOE, *MLA])
def test_drafts_through_each_family(tmp_path, monkeypatch, name):
    path = checkpoint(tmp_path, name)
    prompts = [torch.randint(2, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (21, 34)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [r["token_ids"] for r in make_engine(path, block_size=4, num_blocks=96).generate(prompts, params)]
    wrong = iter(range(10**6))

    def oracle(tokens, k, n_max, n_min):        # the plain continuation, every third token wrong
        for p, out in zip(prompts, plain):
            if tokens[:len(p)].tolist() == p:
                done = len(tokens) - len(p)
                return [t if next(wrong) % 3 else (t + 1) % 250 for t in out[done:done + k]]
        return []
    monkeypatch.setattr(speculative, "lookup", oracle)
    engine = make_engine(path, block_size=4, num_blocks=96, speculative=SpeculativeConfig(min_acceptance=0))
    assert [r["token_ids"] for r in engine.generate(prompts, params)] == plain
    assert engine.stats().spec_accepted_tokens > 0
    if name not in MLA:
        quantized = make_engine(path, block_size=4, num_blocks=96, kv_dtype="int8")
        out = quantized.generate(prompts, params)     # (random weights: no agreement asked, only service)
        assert [len(r["token_ids"]) for r in out] == [24, 24]
