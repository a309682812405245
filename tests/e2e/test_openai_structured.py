"""Structured output with the official `openai` client against a real edge (alone, and with a core)."""

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgecore.shared.engine.sampling_params import GuidedSpec, SamplingParams
from tests.conftest import make_engine
from tests.e2e.guided_schemas import SCHEMAS
from tests.e2e.procs import start_core, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MESSAGES = [{"role": "user", "content": "Describe the list type as JSON."}]


@pytest.fixture(scope="module", params=["with-core", "edge-only"])
def server(request, secret_file):
    core = None
    if request.param == "with-core":     # every prompt would go to the core if it were not guided
        core, port, _ = start_core(secret_file)
        edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
    else:
        edge, http = start_edge()
    yield {"http": http, "mode": request.param}
    edge.stop()
    if core:
        core.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['http']}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _guided_local_prefills(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "edgecore:local_prefills_total" and s.labels.get("reason") == "guided":
                return s.value
    return 0.0


def _schema_request(client, i: int, schema: dict):
    return client.chat.completions.create(
        model="pydoc-llama", messages=MESSAGES, max_tokens=300, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})


def test_twenty_schemas_parse_and_validate(server, client):
    before = _guided_local_prefills(server["http"])
    with ThreadPoolExecutor(8) as pool:      # concurrent: the masks are applied to rows of one batch
        replies = list(pool.map(lambda a: _schema_request(client, *a), enumerate(SCHEMAS)))
    for schema, reply in zip(SCHEMAS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    if server["mode"] == "with-core":    # none went to the core: each was prefilled at the edge, counted so
        assert _guided_local_prefills(server["http"]) - before == len(SCHEMAS)


def test_guided_output_equals_a_single_node_run(client, tokenizer):
    schema = SCHEMAS[9]
    ids = tokenizer.encode_chat(MESSAGES)
    ref = make_engine().generate([ids], SamplingParams(max_tokens=300, temperature=0,
                                                       guided=GuidedSpec("json_schema", json.dumps(schema))))[0]
    assert _schema_request(client, 9, schema).choices[0].message.content == ref["text"]


def test_streamed_json_object_and_vllm_extras(client):
    chunks = list(client.chat.completions.create(model="pydoc-llama", messages=MESSAGES, max_tokens=300,
                                                 temperature=0, stream=True,
                                                 response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict)
    r = client.completions.create(model="pydoc-llama", prompt="The answer is", max_tokens=20, temperature=0.9,
                                  seed=3, n=3, extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert all(c.text in ("yes", "no", "it depends") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model="pydoc-llama", prompt="Version", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"[0-9]\.[0-9]{1,2}"})
    assert re.fullmatch(r"[0-9]\.[0-9]{1,2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="pydoc-llama", prompt="Pick", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'start: "x=" NUM\nNUM: /[0-9]{2}/'})
    assert re.fullmatch(r"x=[0-9]{2}", r.choices[0].text)
