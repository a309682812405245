"""Prompt logprobs equal transformers' log-softmax over the prompt: chunked, batched, and with the prefix cached."""

import pytest
import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine


def reference(hf_model, ids):
    with torch.no_grad():
        logp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logp


@pytest.mark.parametrize("budget", [2048, 7])       # one chunk; many chunks (chunked prefill)
def test_prompt_logprobs_match_transformers(hf_model, tokenizer, budget):
    engine = make_engine(budget=budget)
    ids = tokenizer.encode("The for statement is used to iterate over the elements of a sequence")
    engine.generate([ids], SamplingParams(max_tokens=2, temperature=0))          # prefix now cached
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=3, temperature=0)
    out = engine.generate([ids, ids[:5]], [params, plain])
    assert out[1]["logprobs"] == []
    ref = reference(hf_model, ids)
    state = []
    engine.add_request("p", ids, params)
    while engine.has_unfinished():
        state += [o for o in engine.step() if o.request_id == "p"]
    plps = state[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in state[1:])
    assert len(plps) == len(ids) and plps[0] is None
    for p in range(1, len(ids)):
        lp = plps[p]
        assert lp.token_id == ids[p]
        assert lp.logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert lp.rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        top_ids = ref[p - 1].topk(3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
