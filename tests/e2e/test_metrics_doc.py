"""docs/metrics.md against the /metrics of a real edge and core: the same metrics, both ways, each with
model_name; the short-prompt path, a guided request, a remote prefill and a batch are counted."""

import io
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.procs import start_core, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented() -> dict[str, set[str]]:
    """Section ("Edge", "Core") → metric names in its table."""
    out: dict[str, set[str]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = out.setdefault(line[3:].strip(), set())
        m = re.match(r"\| `(edgecore:[a-z0-9_:]+)` \|", line)
        if m and section is not None:
            section.add(m.group(1))
    return out


def scrape(port: int) -> dict[str, dict]:
    """Exposed metric name (counters with `_total`) → {sample name + labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):       # prometheus_client's creation timestamps, not metrics
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = {}
        for s in family.samples:
            assert s.labels.get("model_name") == "pydoc-llama", s
            out[name][(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: dict, name: str, **labels) -> float:
    """The sum of the samples called `name` (a counter's `_total`, a histogram's `_count`, ...) with `labels`."""
    return sum(v for family in metrics.values() for (sample, lab), v in family.items()
               if sample == name and all(dict(lab).get(k) == x for k, x in labels.items()))


@pytest.fixture(scope="module")
def nodes(secret_file, tmp_path_factory):
    core, port, core_http = start_core(secret_file, data_dir=str(tmp_path_factory.mktemp("core")))
    edge, http = start_edge("--local-prefill-below", "8", cores=[port], secret_file=secret_file)
    yield {"edge": http, "core": core_http}
    edge.stop()
    core.stop()


def _traffic(nodes):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{nodes['edge']}/v1", api_key="x", max_retries=0, timeout=60)
    long_prompt = "The for statement in Python iterates over the items of any sequence, in order."
    client.completions.create(model="pydoc-llama", prompt=long_prompt, max_tokens=6, temperature=0)   # remote
    client.completions.create(model="pydoc-llama", prompt="The", max_tokens=6, temperature=0)         # short
    client.completions.create(model="pydoc-llama", prompt=long_prompt, max_tokens=6, temperature=0,
                              extra_body={"guided_regex": "[0-9]"})              # guided: one token
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="pydoc-llama", prompt="x", max_tokens=2, presence_penalty=9)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"http://127.0.0.1:{nodes['core']}/v1/batches/batch_nope", timeout=10)
    core = openai.OpenAI(base_url=f"http://127.0.0.1:{nodes['core']}/v1", api_key="x", max_retries=0, timeout=60)
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "pydoc-llama", "prompt": "The list", "max_tokens": 5, "temperature": 0}}
            for i in range(3)]
    f = core.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())),
                          purpose="batch")
    batch = core.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while core.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_doc_and_exposition_name_the_same_metrics(nodes):
    _traffic(nodes)
    doc = documented()
    edge, core = scrape(nodes["edge"]), scrape(nodes["core"])
    assert set(edge) == doc["Edge"], (set(edge) ^ doc["Edge"])
    assert set(core) == doc["Core"], (set(core) ^ doc["Core"])
    assert value(edge, "edgecore:local_prefills_total", reason="short") == 1
    assert value(edge, "edgecore:local_prefills_total", reason="guided") == 1
    assert value(edge, "edgecore:remote_prefills_total") == 1
    assert value(edge, "edgecore:handover_requests_total") == 1       # the remote one asked the core to decode
    assert value(edge, "edgecore:request_errors_total", status="400") == 1
    assert value(edge, "edgecore:request_generation_tokens_count") == 3
    assert value(edge, "edgecore:time_per_output_token_seconds_count") == 2      # not the one-token answer
    assert value(edge, "edgecore:prefix_cache_queries_total") > 0
    assert value(edge, "edgecore:iteration_tokens_count") > 0
    assert value(core, "edgecore:request_errors_total", status="404") == 1
    assert value(core, "edgecore:core_batch_requests_completed_total") == 3
    assert value(core, "edgecore:core_batch_generation_tokens_total") == 15
    assert value(core, "edgecore:core_batch_prompt_tokens_total") > 0
    assert value(core, "edgecore:core_batch_requests_running") == 0
    assert value(core, "edgecore:core_prefill_requests_total", outcome="ok") == 1
    assert value(core, "edgecore:cache_config_info") == 1
