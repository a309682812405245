"""`edgecore edge --compile`: the engine process compiles its decode step before the node says it is ready, and
then serves concurrent completions with the same tokens as single-node eager generation."""

import concurrent.futures

import pytest

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import Node, free_port, get_json, post_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_compiled_edge_serves_as_single_node(model_dir, tokenizer, heldout):
    http = free_port()
    edge = Node(["edge", "--listen", f"127.0.0.1:{http}", "--compile"], env={"EDGECORE_THREADS": "2"},
                ready_timeout=300)
    try:
        assert "decode step compiled" in edge.logs()
        ids = tokenizer.encode(heldout)
        prompts = [ids[i * 50: i * 50 + n] for i, n in enumerate((4, 15, 33, 70, 120, 9))]
        body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda p: post_json(f"http://127.0.0.1:{http}/v1/completions",
                                                        {"prompt": p, **body}), prompts))
        # The compiled step served (at least the decode steps after the last prefill), and was never dropped.
        assert get_json(f"http://127.0.0.1:{http}/stats")["compiled_steps"] >= 19
        assert "serving eagerly" not in edge.logs()
    finally:
        edge.stop()
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for prompt, reply in zip(prompts, replies):
        assert reply["choices"][0]["text"] == engine.generate([prompt], params)[0]["text"]
