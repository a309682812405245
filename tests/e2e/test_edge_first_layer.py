"""An in-process edge and core over a real socket, q4e: the edge computes layer 0 itself and the core sends the
other layers only; if the edge's own layer 0 fails, the transfer fails (never an activation with layer 0
missing) and the request is served by the fallback, with single-node output."""

import pytest

from edgecore.core.server import CoreConfig, CoreServer
from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


async def run(edge, rid, prompt):
    tokens = []
    async for out in edge.generate(rid, prompt, GREEDY):
        tokens += out.new_token_ids
    return tokens


@pytest.fixture
async def pair(model_dir, tmp_path):
    core = CoreServer(CoreConfig(str(model_dir), b"s", port=0, http_port=None, data_dir=str(tmp_path),
                                 dtype="bf16"))
    await core.start()
    edges = []

    async def edge(**kw):
        e = EdgeNode(EdgeConfig(str(model_dir), cores=[("127.0.0.1", core.port)], secret=b"s", codecs=["q4e"],
                                  local_prefill_below=0, max_core_attempts=1, **kw), engine=make_engine())
        await e.start()
        edges.append(e)
        return e
    yield core, edge
    for e in edges:
        await e.stop()
    await core.stop()


async def test_layer0_stays_home_and_a_failure_falls_back(pair, tokenizer, heldout):
    core, make_edge = pair
    prompt = tokenizer.encode(heldout)[100:300]
    ref = make_engine().generate([prompt], GREEDY)[0]["token_ids"]
    cfg = make_engine().config

    edge = await make_edge()
    calls = []
    real = edge.handle.engine.write_first_layer_kv
    edge.handle.engine.write_first_layer_kv = lambda rid: (calls.append(rid), real(rid))[1]
    tokens = await run(edge, "a", prompt)
    assert calls == ["a"] and tokens[:4] == ref[:4]
    raw = edge.metrics.kv_raw_bytes.labels("q4e")._value.get()
    assert raw == len(prompt) * cfg.kv_bytes_per_token(2) * (cfg.num_hidden_layers - 1) // cfg.num_hidden_layers

    def broken(rid):
        raise RuntimeError("no memory for layer 0")
    edge.handle.engine.write_first_layer_kv = broken
    failovers = edge.metrics.failovers._value.get()
    assert await run(edge, "b", prompt) == ref          # the fallback (local prefill) is exact
    assert edge.metrics.failovers._value.get() == failovers + 1
