"""gpt-oss (MoE with biases and sinks, sliding and full layers) through the real multi-process paths:
`--tp 2` and `--pp 2` cores give single-process logits and tokens; a lossless core → edge
disaggregated run gives single-node outputs. One MoE architecture end to end (the others share its
MoE, attention and loading code and are checked against transformers in tests/shared)."""

import json
import shutil

import pytest
import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import MODEL_DIR, make_engine
from tests.e2e.procs import post_json, start_core, start_edge
from tests.e2e.procs import metric
from tests.e2e.test_parallel import probe
from tests.helpers import stepwise_logits
from tests.shared.moe_checkpoints import build

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    path, _ = build(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss")
    for name in ("tokenizer.json", "tokenizer_config.json"):     # ids < 257 decode as bytes
        shutil.copy(MODEL_DIR / name, path / name)
    return path


def token_prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 257, (n,), generator=g).tolist() for n in (5, 17, 40)]


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_moe_logits_and_tokens_match_one_process(tp, pp, gpt_oss_dir, tmp_path):
    ids = torch.randint(2, 257, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    got = probe(gpt_oss_dir, tp, pp, ids, len(ids) - 8, token_prompts(), tmp_path)
    engine = make_engine(gpt_oss_dir)
    ref = stepwise_logits(engine, ids, len(ids) - 8)
    assert (torch.tensor(got["logits"]) - ref).abs().max().item() <= 1e-5
    greedy = engine.generate(token_prompts(), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert got["greedy"] == [r["token_ids"] for r in greedy]


def test_disaggregated_lossless_moe_equals_single_node(gpt_oss_dir, secret_file):
    core, port, _ = start_core(secret_file, "--model", str(gpt_oss_dir))
    edge, http = start_edge("--local-prefill-below", "0", "--codec", "lossless", "--model", str(gpt_oss_dir),
                            cores=[port], secret_file=secret_file)
    try:
        prompts = token_prompts()
        ref = make_engine(gpt_oss_dir).generate(prompts, SamplingParams(max_tokens=24, temperature=0,
                                                                        ignore_eos=True))
        counter = 'edgecore:remote_prefills_total{codec="lossless"'
        before = metric(http, counter)
        for prompt, r in zip(prompts, ref):
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 1}
            out = post_json(f"http://127.0.0.1:{http}/v1/completions", body)
            assert out["choices"][0]["text"] == r["text"], json.dumps(out)[:500]
        assert metric(http, counter) - before == len(prompts)        # every prefill ran on the core
    finally:
        edge.stop()
        core.stop()
