"""MLA under tensor and pipeline parallelism (gloo on CPU, real rank processes): query heads split across
ranks with the latent replicated; logits and greedy tokens equal one process; the latent has one sender."""

import pytest
import torch

from edgecore.core.ranks import owns_kv
from edgecore.shared.models.config import ModelConfig
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.test_parallel import probe
from tests.helpers import stepwise_logits
from tests.shared.deepseek_checkpoints import deepseek_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    path, _ = deepseek_checkpoint(tmp_path_factory.mktemp("mla"), "v3-qlora-yarn-grouped")
    return path


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_mla_parallel_logits_and_tokens_match_one_process(mla_dir, tp, pp, tmp_path):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 257, (60,), generator=g).tolist()
    prompts = [torch.randint(2, 257, (n,), generator=g).tolist() for n in (5, 17, 40)]
    got = probe(mla_dir, tp, pp, ids, len(ids) - 8, prompts, tmp_path)
    engine = make_engine(mla_dir)
    ref = stepwise_logits(engine, ids, len(ids) - 8)
    assert (torch.tensor(got["logits"]) - ref).abs().max().item() <= 1e-4
    greedy = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert got["greedy"] == [r["token_ids"] for r in greedy]


def test_latent_has_one_sender_per_tp_group(mla_dir):
    """The latent is one "KV head": only TP rank 0 owns it, the other ranks hold replicas and send nothing."""
    heads = ModelConfig.from_dir(mla_dir).num_key_value_heads
    assert heads == 1
    for tp in (2, 4, 8):
        assert [owns_kv(rank, tp, heads) for rank in range(tp)] == [True] + [False] * (tp - 1)
