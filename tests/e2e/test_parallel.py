"""Tensor and pipeline parallelism on CPU (gloo, real processes): logits and tokens equal one process;
an edge decodes KV from TP and PP cores; a dead rank makes the core unhealthy without hangs."""

import json
import subprocess
import sys

import pytest
import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.layers import weight_bytes
from tests.conftest import make_engine
from tests.e2e.procs import ROOT, get_json, metric, post_json, start_core, start_edge, wait_for
from tests.helpers import random_hf_checkpoint, stepwise_logits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
LAYOUTS = [(2, 1), (1, 2), (2, 2)]


def probe(model_dir, tp, pp, ids, prefill, prompts, tmp_path):
    out = tmp_path / f"probe-{tp}-{pp}.json"
    r = subprocess.run([sys.executable, "-m", "tests.parallel_probe", "--model", str(model_dir), "--tp", str(tp),
                        "--pp", str(pp), "--ids", json.dumps(ids), "--prefill", str(prefill), "--prompts",
                        json.dumps(prompts), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=240, env={"PATH": "/usr/bin:/bin", "EDGECORE_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path, _ = random_hf_checkpoint(tmp_path_factory.mktemp("qwen"), "qwen2", num_attention_heads=4,
                                   num_key_value_heads=4, num_hidden_layers=4, hidden_size=64, intermediate_size=128)
    return path


@pytest.mark.parametrize("tp, pp", LAYOUTS)
@pytest.mark.parametrize("which", ["bundled", "qwen2-4kv"])
def test_parallel_logits_and_tokens_match_one_process(tp, pp, which, model_dir, qwen_dir, tmp_path, tokenizer,
                                                      heldout):
    path = model_dir if which == "bundled" else qwen_dir
    if which == "bundled":
        ids = tokenizer.encode(heldout[:1500])[:120]
        prompts = [tokenizer.encode(t) for t in ("The for statement", "A dictionary maps", "import sys\n")]
    else:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(2, 257, (60,), generator=g).tolist()
        prompts = [torch.randint(2, 257, (n,), generator=g).tolist() for n in (5, 17, 40)]
    got = probe(path, tp, pp, ids, len(ids) - 8, prompts, tmp_path)
    engine = make_engine(path)
    ref = stepwise_logits(engine, ids, len(ids) - 8)
    assert (torch.tensor(got["logits"]) - ref).abs().max().item() <= 1e-4
    greedy = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert got["greedy"] == [r["token_ids"] for r in greedy]
    full = weight_bytes(engine.model)
    ranks = got["ranks"]
    assert len(ranks) == tp * pp and all(r["steps"] > 0 and r["compute_seconds"] > 0 for r in ranks)
    if tp == 2 and pp == 1:      # sharded: about half each, plus the replicated norms
        assert all(r["parameter_bytes"] < 0.65 * full for r in ranks)


@pytest.mark.parametrize("tp, pp, gather", [(2, 1, False), (1, 2, False), (2, 2, False), (1, 2, True)])
def test_edge_decodes_kv_from_parallel_core(tp, pp, gather, secret_file, tokenizer, heldout):
    core, port, core_http = start_core(secret_file, "--tp", str(tp), "--pp", str(pp), *(["--gather-kv"] * gather))
    edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
    try:
        stats = get_json(f"http://127.0.0.1:{core_http}/stats")
        assert stats["layout"]["tp"] == tp and [r["rank"] for r in stats["ranks"]] == list(range(tp * pp))
        # Direct: the edge holds a stream connection to every other rank, which sends its own KV there.
        assert get_json(f"http://127.0.0.1:{http}/stats")["cores"][0]["stream_connections"] == (0 if gather else tp * pp - 1)
        ids = tokenizer.encode(heldout)
        prompts = [ids[i * 100: i * 100 + n] for i, n in enumerate((7, 60, 300))]
        ref = make_engine().generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(3) as pool:     # at once: prefilled together, in micro-batches on a pipeline
            outs = list(pool.map(lambda p: post_json(f"http://127.0.0.1:{http}/v1/completions", {
                "prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}), prompts))
        assert [o["choices"][0]["text"] for o in outs] == [r["text"] for r in ref]
        assert metric(http, 'edgecore:remote_prefills_total{codec="lossless"') == 3    # no fallback
        # Decode handover on a parallel core: it decoded for each request (none refused) until the edge took over.
        assert get_json(f"http://127.0.0.1:{core_http}/stats")["handover"]["decode_requests"] == 3
        # Each counted once at the edge, when the core's stop has come (which a short reply may outlast).
        assert wait_for(lambda: metric(http, "edgecore:handover_requests_total{") == 3)
        received = metric(http, 'edgecore:kv_raw_bytes_received_total{codec="lossless"')
        from_rank0 = metric(core_http, 'edgecore:core_kv_raw_bytes_total{codec="lossless"')
        assert received > 0
        # Rank 0 holds half the KV (2 KV heads over TP=2, 4 layers over PP=2), a quarter at TP=2×PP=2.
        assert from_rank0 == (received if gather else received / (tp * pp))
    finally:
        edge.stop()
        core.stop()
    # Every rank went down with the core.
    assert wait_for(lambda: subprocess.run(["pgrep", "-f", "edgecore core-worker"],
                                           capture_output=True).returncode != 0, 15)


@pytest.mark.parametrize("gather", [False, True])
def test_layer0_at_the_edge_with_a_pipeline_core(gather, secret_file, tokenizer, heldout):
    """q4e: the edge computes layer 0 and no rank sends it, whether each stage streams its own layers or
    rank 0 gathers them; every transfer completes (no fallback) and decodes."""
    core, port, core_http = start_core(secret_file, "--pp", "2", "--dtype", "bf16", *(["--gather-kv"] * gather))
    edge, http = start_edge("--local-prefill-below", "0", "--codec", "q4e", "--dtype", "bf16", cores=[port],
                            secret_file=secret_file)
    try:
        ids = tokenizer.encode(heldout)
        prompts = [ids[i * 100: i * 100 + n] for i, n in enumerate((60, 300))]
        ref = make_engine(dtype="bf16").generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                         ignore_eos=True))
        outs = [post_json(f"http://127.0.0.1:{http}/v1/completions", {
            "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}) for p in prompts]
        for out, r in zip(outs, ref):       # lossy layers 1..3: the start is single node's
            assert out["choices"][0]["text"].startswith(tokenizer.decode(r["token_ids"][:3]))
        assert metric(http, 'edgecore:remote_prefills_total{codec="q4e"') == 2      # no fallback
        cfg = make_engine().config
        raw = metric(http, 'edgecore:kv_raw_bytes_received_total{codec="q4e"')
        layers = cfg.num_hidden_layers
        assert raw == sum(len(p) for p in prompts) * cfg.kv_bytes_per_token(2) * (layers - 1) // layers
    finally:
        edge.stop()
        core.stop()


def test_killing_a_rank_makes_core_unhealthy_and_edge_fail_over(secret_file, tokenizer):
    core, port, core_http = start_core(secret_file, "--tp", "2")
    edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
    try:
        pids = subprocess.run(["pgrep", "-f", "core-worker --rank 1"], capture_output=True, text=True).stdout.split()
        assert pids
        for pid in pids:
            subprocess.run(["kill", "-9", pid])
        assert wait_for(lambda: get_json(f"http://127.0.0.1:{core_http}/stats")["failure"], 20)
        import urllib.error
        import urllib.request
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"http://127.0.0.1:{core_http}/ready")
        assert exc.value.code == 503
        prompt = tokenizer.encode("The with statement is used to wrap the execution of a block")
        out = post_json(f"http://127.0.0.1:{http}/v1/completions",
                        {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert out["choices"][0]["finish_reason"] == "length"
        assert wait_for(lambda: not get_json(f"http://127.0.0.1:{http}/stats")["cores"][0]["healthy"], 20)
    finally:
        edge.stop()
        core.stop()


async def test_gathered_kv_of_a_model_windowed_everywhere_is_read_before_any_block_is_released(secret_file, tmp_path):
    """A parallel core that gathers the KV after the prefill (here: --gather-kv) must not decode on for a
    handover when every layer is windowed: its decode steps release the blocks the edge still needs before
    they are read (the ranks crashed on them). It answers DecodeStop instead and stays healthy."""
    from edgecore.edge.node import EdgeConfig, EdgeNode
    from edgecore.shared.engine.sampling_params import SamplingParams
    from tests.conftest import make_engine
    from tests.helpers import random_hf_checkpoint
    path, _ = random_hf_checkpoint(tmp_path / "mistral", "mistral", sliding_window=8, num_hidden_layers=3)
    core, port, core_http = start_core(secret_file, "--model", str(path), "--dtype", "fp32", "--tp", "2",
                                       "--gather-kv", ready_timeout=240)
    edge = EdgeNode(EdgeConfig(str(path), cores=[("127.0.0.1", port)], secret=open(secret_file, "rb").read().strip(),
                                 local_prefill_below=0, max_core_attempts=1, handover_tokens=4, dtype="fp32"),
                      engine=make_engine(path))
    await edge.start()
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for prompt in (list(range(2, 42)), list(range(50, 83))):      # past the window and a 16-token block
            got = [t async for out in edge.generate(f"r{prompt[0]}", prompt, params) for t in out.new_token_ids]
            assert got == make_engine(path).generate([prompt], params)[0]["token_ids"]
        assert edge.metrics.failovers._value.get() == 0           # both prefilled at the core, none locally
        stats = get_json(f"http://127.0.0.1:{core_http}/stats")
        assert stats["engine_alive"] and stats["handover"]["decode_requests"] == 0
    finally:
        await edge.stop()
        core.stop()
