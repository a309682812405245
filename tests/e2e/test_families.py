"""Qwen3, Qwen3-MoE, Mixtral (sliding window 8) and Llama 4 text (attention chunk 8) through the real
multi-process paths, with prompts longer than the window and the chunk (gpt-oss: test_moe_e2e.py).

Per family, one core and one lossless edge (module-scoped, one family's processes at a time):
- core → edge disaggregated, lossless: completions identical to a single-node engine (the windowed
  families' cores send only each layer's window; every prefill ran on the core);
- the core's Files + Batches API: a small batch gives the single-node completions.
A lossy codec (int8) on every family (on the windowed ones, their cut slices are what int8 groups and keeps
exact): the first tokens agree with single node. `--tp 2` and `--pp 2` on every family: logits within 1e-5
of one process (fp32), greedy tokens equal (TP: per-head q/k norm on sharded heads, sharded experts, the
shared expert and top-1 sigmoid routing; PP: dense/sparse and chunked/NoPE layers by global layer index).
An edge behind a parallel core gets exactly each layer's window: Llama 4 from a `--pp 2` core (each stage
streams and cuts its own layers) and Mixtral from a `--tp 2 --gather-kv` core (rank 0 cuts what it gathers).
"""

import io
import json
import shutil
import time
from unittest import mock

import openai
import pytest
import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import needed_from
from tests.conftest import MODEL_DIR, make_engine
from tests.e2e.procs import metric, post_json, start_core, start_edge
from tests.e2e.test_parallel import probe
from tests.helpers import stepwise_logits
from tests.shared import moe_checkpoints
from tests.shared.moe_checkpoints import build

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
FAMILIES = ["qwen3", "qwen3_moe", "mixtral-sliding", "llama4"]
WINDOWED = {"mixtral-sliding", "llama4"}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def checkpoint(tmp_path_factory, name: str):
    with mock.patch.dict(moe_checkpoints.ARCHS, {"qwen3": ("qwen3", {})}):     # dense Qwen3, same sizes
        path, _ = build(tmp_path_factory.mktemp(name), name)
    for f in ("tokenizer.json", "tokenizer_config.json"):     # ids < 257 decode as bytes
        shutil.copy(MODEL_DIR / f, path / f)
    return path


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(2, 257, (n,), generator=g).tolist() for n in (43, 21, 12)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, secret_file):
    name = request.param
    path = checkpoint(tmp_path_factory, name)
    core, port, http = start_core(secret_file, "--model", str(path))
    try:
        # No decode handover: the bytes on the wire are checked, and a reply that ended on the core would
        # leave part of its KV unsent.
        edge, edge_http = start_edge("--local-prefill-below", "0", "--codec", "lossless", "--handover-max-tokens", "0",
                                     "--model", str(path), cores=[port], secret_file=secret_file)
    except BaseException:
        core.stop()
        raise
    ref = make_engine(path).generate(prompts(), GREEDY)
    yield {"name": name, "path": path, "core_port": port, "core_http": http, "edge_http": edge_http, "ref": ref}
    edge.stop()
    core.stop()


def completions(http: int, prompt: list[int], max_tokens: int = 16) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return post_json(f"http://127.0.0.1:{http}/v1/completions", body)


def test_disaggregated_lossless_equals_single_node(family):
    http = family["edge_http"]
    counter = 'edgecore:remote_prefills_total{codec="lossless"'
    before = metric(http, counter)
    for prompt, r in zip(prompts(), family["ref"]):
        out = completions(http, prompt)
        assert out["choices"][0]["text"] == r["text"], (family["name"], json.dumps(out)[:300])
    assert metric(http, counter) - before == len(prompts())        # every prefill ran on the core
    # Exactly each layer's needed tokens travelled (a windowed layer: its window only).
    cfg = make_engine(family["path"]).config
    cells = sum(len(p) - start for p in prompts() for start in needed_from(cfg, len(p)))
    if family["name"] in WINDOWED:
        assert cells < 0.6 * sum(len(p) for p in prompts()) * cfg.num_hidden_layers
    raw = metric(http, 'edgecore:kv_raw_bytes_received_total{codec="lossless"')
    assert raw in {cells * 2 * cfg.num_key_value_heads * cfg.head_dim * size for size in (2, 4)}, raw


def test_batch_api_equals_single_node(family):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{family['core_http']}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    rows = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}}
            for i, p in enumerate(prompts())]
    f = client.files.create(file=("in.jsonl", io.BytesIO(("\n".join(map(json.dumps, rows)) + "\n").encode())),
                            purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == len(rows)
    out = {o["custom_id"]: o for o in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    for i, r in enumerate(family["ref"]):
        assert out[f"c-{i}"]["response"]["body"]["choices"][0]["text"] == r["text"], family["name"]


def test_int8_agrees_on_the_first_tokens(family, secret_file):
    path = family["path"]
    edge, http = start_edge("--local-prefill-below", "0", "--codec", "int8", "--engine-in-process",
                            "--model", str(path), cores=[family["core_port"]], secret_file=secret_file)
    try:
        ref = make_engine(path).generate(prompts(), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        for prompt, r in zip(prompts(), ref):
            assert completions(http, prompt, 3)["choices"][0]["text"] == r["text"], family["name"]
        assert metric(http, 'edgecore:remote_prefills_total{codec="int8"') == len(prompts())
    finally:
        edge.stop()


@pytest.mark.parametrize("name, tp, pp", [(name, tp, pp) for name in FAMILIES for tp, pp in ((2, 1), (1, 2))])
def test_parallel_logits_equal_one_process(name, tp, pp, tmp_path_factory, tmp_path):
    path = checkpoint(tmp_path_factory, name)
    ids = torch.randint(2, 257, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    got = probe(path, tp, pp, ids, len(ids) - 8, prompts(), tmp_path)
    engine = make_engine(path)
    ref = stepwise_logits(engine, ids, len(ids) - 8)
    assert (torch.tensor(got["logits"]) - ref).abs().max().item() <= 1e-5
    assert got["greedy"] == [r["token_ids"] for r in engine.generate(prompts(), SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True))]


@pytest.mark.parametrize("name, tp, pp, gather", [("llama4", 1, 2, False), ("mixtral-sliding", 2, 1, True)])
def test_edge_decodes_windowed_kv_from_a_parallel_core(name, tp, pp, gather, tmp_path_factory, secret_file):
    """Each rank cuts its own layers (direct streams, by global layer index), or rank 0 cuts the gathered
    KV (`--gather-kv`): the edge gets exactly each layer's window and decodes like one node."""
    path = checkpoint(tmp_path_factory, name)
    core, port, _ = start_core(secret_file, "--model", str(path), "--tp", str(tp), "--pp", str(pp),
                               *(["--gather-kv"] * gather))
    try:       # no decode handover: a short reply could end on the core before its KV is sent, unmeasured
        edge, http = start_edge("--local-prefill-below", "0", "--handover-max-tokens", "0", "--model", str(path),
                                cores=[port], secret_file=secret_file)
    except BaseException:
        core.stop()
        raise
    try:
        engine = make_engine(path)
        for prompt, r in zip(prompts(), engine.generate(prompts(), GREEDY)):
            assert completions(http, prompt)["choices"][0]["text"] == r["text"]
        cfg = engine.config
        cells = sum(len(p) - start for p in prompts() for start in needed_from(cfg, len(p)))
        raw = metric(http, 'edgecore:kv_raw_bytes_received_total{codec="lossless"')
        assert raw in {cells * 2 * cfg.num_key_value_heads * cfg.head_dim * size for size in (2, 4)}, raw
        assert metric(http, 'edgecore:remote_prefills_total{codec="lossless"') == len(prompts())
    finally:
        edge.stop()
        core.stop()
