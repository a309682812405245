"""An edge's own layer 0: `write_first_layer_kv` computes the K/V that layer 0 of a full prefill writes, for every
model family (qk-norm and biases, MLA's latent, sliding/chunked and no-RoPE layers, attention sinks), only for
the uncached tokens, and a request whose layer 0 came from there and the other layers from a core decodes as
single-node generation does."""

import pytest
import torch

from edgecore.shared.engine import model_runner
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import KVSlice
from tests.conftest import MODEL_DIR, make_engine
from tests.helpers import random_hf_checkpoint
from tests.shared import moe_checkpoints
from tests.shared.deepseek_checkpoints import deepseek_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run(engine):
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def layer_kv(engine, rid: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K/V (as the cache stores them) of a request's tokens [start, end)."""
    slots = engine.pool.slots(engine.requests[rid].seq.table.blocks, start, end)
    return engine.pool.read(0, slots)


def prefilled_kv(model_dir, prompt, **kw):
    core = make_engine(model_dir, **kw)
    core.add_request("p", prompt, SamplingParams(max_tokens=1), prefill_only=True)
    run(core)
    return core.read_kv_slices("p", 0, len(prompt))[0]


def checkpoints():
    yield "pydoc-llama", lambda tmp: None
    yield "qwen3-bias-qknorm", lambda tmp: random_hf_checkpoint(tmp, "qwen3", head_dim=16, attention_bias=True)[0]
    yield "deepseek-mla", lambda tmp: deepseek_checkpoint(tmp, "v3-qlora-yarn-grouped")[0]
    for name in ("mixtral-sliding", "gpt_oss", "llama4"):
        yield name, lambda tmp, n=name: moe_checkpoints.build(tmp, n)[0]


@pytest.mark.parametrize("name,make", list(checkpoints()), ids=[n for n, _ in checkpoints()])
def test_first_layer_kv_equals_the_prefills(tmp_path, name, make):
    model_dir = make(tmp_path) or MODEL_DIR
    prompt = [(7 * i + 3) % 200 + 2 for i in range(45)]
    whole = prefilled_kv(model_dir, prompt)
    edge = make_engine(model_dir)
    assert edge.runner.layer0_macs_per_token > 0
    edge.reserve("r", prompt, GREEDY)
    slots = edge.pool.slots(edge.requests["r"].seq.table.blocks, 0, len(prompt))
    others = [edge.pool.read(layer, slots) for layer in range(1, edge.config.num_hidden_layers)]
    edge.write_first_layer_kv("r")
    k, v = layer_kv(edge, "r", 0, len(prompt))
    torch.testing.assert_close(k, whole.k[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, whole.v[0], rtol=1e-5, atol=1e-5)
    for layer, (k1, v1) in enumerate(others, start=1):      # no other layer written
        assert torch.equal(edge.pool.read(layer, slots)[0], k1) and torch.equal(edge.pool.read(layer, slots)[1], v1)


def test_only_uncached_tokens_are_computed(tokenizer, heldout):
    """A cached prefix keeps its KV; layer 0 of the rest is computed."""
    ids = tokenizer.encode(heldout)
    prefix, prompt = ids[:64], ids[:64] + ids[500:530]
    edge = make_engine()
    edge.generate([prefix + [5]], SamplingParams(max_tokens=1))     # puts the 64-token prefix in the cache
    _, cached = edge.reserve("r", prompt, GREEDY)
    assert cached == 64
    before = layer_kv(edge, "r", 0, len(prompt))
    edge.write_first_layer_kv("r")
    after = layer_kv(edge, "r", 0, len(prompt))
    whole = prefilled_kv(MODEL_DIR, prompt)
    assert torch.equal(after[0][:cached], before[0][:cached])
    torch.testing.assert_close(after[0][cached:], whole.k[0][cached:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[1][cached:], whole.v[0][cached:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("piece", [2048, 16])       # one piece; 19 pieces, the last partial
def test_layer0_here_and_the_rest_from_a_core_decodes_as_single_node(tokenizer, heldout, piece, monkeypatch):
    monkeypatch.setattr(model_runner, "FIRST_LAYER_PIECE", piece)
    prompt = tokenizer.encode(heldout)[2000:2300]
    ref = make_engine().generate([prompt], GREEDY)[0]["token_ids"]
    whole = prefilled_kv(MODEL_DIR, prompt)
    edge = make_engine(prefix_caching=False)
    edge.reserve("r", prompt, GREEDY)
    edge.write_first_layer_kv("r")
    edge.write_kv("r", KVSlice(1, 0, len(prompt), 0, whole.k[1:], whole.v[1:]))     # no layer 0 from the core
    edge.activate("r", ref[0])
    assert [t for out in run(edge) for t in out.new_token_ids] == ref


def test_a_released_request_is_left_alone():
    """The command is queued behind the PrefillRequest: a request released meanwhile needs nothing."""
    edge = make_engine()
    edge.reserve("r", [5, 6, 7], GREEDY)
    edge.release("r")
    edge.write_first_layer_kv("r")
    edge.write_first_layer_kv("never-reserved")
    assert edge.block_manager.num_used == 0
