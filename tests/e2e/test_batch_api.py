"""The core's batch API with the official `openai` client; crash/restart exactly-once; contexts."""

import io
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import get_json, post_json, start_core, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def jsonl(rows) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def completion_line(cid, prompt, max_tokens=12, url="/v1/completions", **body):
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "pydoc-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}}


@pytest.fixture(scope="module")
def core(secret_file, tmp_path_factory):
    data = tmp_path_factory.mktemp("core-data")
    node, port, http = start_core(secret_file, "--max-file-mb", "1", data_dir=str(data))
    yield {"node": node, "http": http, "data": data}
    node.stop()


@pytest.fixture(scope="module")
def client(core):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{core['http']}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def wait_batch(client, batch_id, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {b.status}")


def test_batch_results_equal_direct_generation(client, tokenizer):
    prompts = ["The for statement", "A list comprehension", "import os", "Exceptions are", "The with statement"]
    rows = [completion_line(f"c-{i}", p) for i, p in enumerate(prompts)]
    rows.append({"custom_id": "chat-1", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}})
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "eval"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "eval"}
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6 and done.request_counts.failed == 0
    assert done.completed_at >= done.in_progress_at >= done.created_at
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    by_id = {o["custom_id"]: o for o in out}
    ref = make_engine().generate([tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=12, temperature=0))
    for i, r in enumerate(ref):
        resp = by_id[f"c-{i}"]["response"]
        assert resp["status_code"] == 200 and resp["body"]["choices"][0]["text"] == r["text"]
    assert by_id["chat-1"]["error"] is None
    assert batch.id in [b.id for b in client.batches.list(limit=10).data]


def test_prompt_logprobs_and_echo_lines_run(client):
    """Lines asking for prompt logprobs run on a single-rank core, beside the others (one such line failed the
    whole batch)."""
    rows = [completion_line("plp", "The for statement", max_tokens=2, prompt_logprobs=1),
            completion_line("echo", "A list", max_tokens=2, echo=True, logprobs=1),
            completion_line("plain", "import os", max_tokens=2)]
    f = client.files.create(file=("plp.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    done = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    by_id = {o["custom_id"]: o["response"]["body"]["choices"][0]
             for o in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    plps = by_id["plp"]["prompt_logprobs"]
    assert plps[0] is None and len(plps) > 1 and all(isinstance(e, dict) for e in plps[1:])
    assert by_id["echo"]["text"].startswith("A list") and by_id["echo"]["logprobs"]["token_logprobs"]


def test_cancelled_while_validating_runs_no_request(client):
    """Validation runs off the event loop, so a cancel is answered at once; once acknowledged, no request
    of the batch starts."""
    rows = [completion_line(f"v{i}", "x", max_tokens=1) for i in range(6000)]
    data = jsonl(rows)
    assert len(data) < 1 << 20                       # under this core's --max-file-mb 1
    f = client.files.create(file=("many.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.request_counts.completed == 0, done.request_counts


def test_chat_batch_and_listing(client):
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": f"Question {i}"}], "max_tokens": 5,
                      "temperature": 0}} for i in range(3)]
    f = client.files.create(file=("chat.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["q0", "q1", "q2"]
    assert all(o["response"]["body"]["object"] == "chat.completion" for o in out)
    first = client.batches.list(limit=1)
    assert len(first.data) == 1 and first.has_more
    after = client.batches.list(limit=1, after=first.data[0].id)
    assert after.data[0].id != first.data[0].id
    assert f.id in [x.id for x in client.files.list().data]
    one = client.files.list(limit=1, order="asc")
    assert len(one.data) == 1 and one.has_more
    assert client.files.list(limit=1, order="asc", after=one.data[0].id).data[0].id != one.data[0].id
    for bad in ({"limit": 0}, {"limit": 10001}, {"order": "sideways"}):
        with pytest.raises(openai.BadRequestError):
            client.files.list(**bad)
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_malformed_lines_go_to_error_file_and_rest_run(client):
    lines = [json.dumps(completion_line("ok-1", "Hello")), "{not json", json.dumps(completion_line("ok-1", "dup")),
             json.dumps(completion_line("wrong-url", "x", url="/v1/embeddings")),
             json.dumps({**completion_line("bad-method", "x"), "method": "GET"}),
             json.dumps(completion_line("too-long", "x", max_tokens=5000)),
             json.dumps(completion_line("ok-2", "World")),
             json.dumps(completion_line("no-text-matches", "x", guided_regex="[^\\s\\S]"))]   # found by the engine
    f = client.files.create(file=("mixed.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed"
    assert b.request_counts.total == 8 and b.request_counts.completed == 2 and b.request_counts.failed == 6
    errors = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    lines_reported = sorted(e["error"]["line"] for e in errors)
    assert lines_reported == [2, 3, 4, 5, 6, 8]
    assert any("matches no text" in e["error"]["message"] and e["custom_id"] == "no-text-matches" for e in errors)
    assert any("duplicate custom_id" in e["error"]["message"] for e in errors)
    assert any("context length" in e["error"]["message"] for e in errors)
    out = [json.loads(x)["custom_id"] for x in client.files.content(b.output_file_id).text.splitlines()]
    assert sorted(out) == ["ok-1", "ok-2"]


def test_not_jsonl_fails_batch_and_bad_requests_get_errors(client):
    f = client.files.create(file=("bad.jsonl", io.BytesIO(b"this is not json\nnor this\n")), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                 completion_window="24h").id)
    assert b.status == "failed" and b.errors.data[0].code == "invalid_file"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.APIStatusError) as exc:          # over --max-file-mb 1
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (2 * 1024 * 1024))), purpose="batch")
    assert exc.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")


@pytest.mark.parametrize("ctype,body", [
    ("multipart/form-data; boundary=b", b"--b\r\nxx"),                  # a part cut inside its headers
    ("multipart/form-data", b"--b\r\nxx"),                              # no boundary
    ("multipart/form-data; boundary=b", b"no boundary anywhere"),
    ("multipart/form-data; boundary=b",                                 # a 'purpose' that is not UTF-8
     b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n\xff\xfe\r\n--b--\r\n'),
    ("multipart/form-data; boundary=b", b"".join(                        # two files
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\r\n' for _ in range(2))
     + b"--b--\r\n"),
])
def test_a_malformed_upload_is_a_json_400(core, ctype, body):
    req = urllib.request.Request(f"http://127.0.0.1:{core['http']}/v1/files", data=body, method="POST",
                                 headers={"Content-Type": ctype})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    assert exc.value.code == 400
    assert json.loads(exc.value.read())["error"]["code"] in ("invalid_body", "invalid_value")
    assert not list(core["data"].rglob("*.part"))          # nothing of a refused upload is left


def test_cancel_keeps_finished_results(client):
    n = 1000      # well beyond what runs at once, so the cancel lands mid-batch
    rows = [completion_line(f"r{i}", f"Item {i}:", max_tokens=40, ignore_eos=True) for i in range(n)]
    f = client.files.create(file=("many.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed > 0, 60)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled" and 0 < done.request_counts.completed < n
    out = client.files.content(done.output_file_id).text.splitlines()
    assert len(out) == done.request_counts.completed
    assert len({json.loads(x)["custom_id"] for x in out}) == len(out)


def test_sigkill_mid_batch_resumes_exactly_once(secret_file, tmp_path):
    data = tmp_path / "data"
    node, port, http = start_core(secret_file, data_dir=str(data))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0, timeout=60)
    rows = [completion_line(f"k{i}", f"Entry {i} of the list", max_tokens=24, ignore_eos=True) for i in range(300)]
    f = client.files.create(file=("300.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 40, 120, 0.02)
    node.kill()
    import sqlite3
    db = sqlite3.connect(data / "batches.sqlite3")
    done_at_kill = db.execute("SELECT COUNT(*) FROM batch_requests WHERE state = 'done'").fetchone()[0]
    db.close()
    assert 40 <= done_at_kill < 300          # killed in the middle
    partial = None
    node, port, http = start_core(secret_file, data_dir=str(data))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0, timeout=60)
        partial = client.batches.retrieve(batch.id)
        assert partial.status in ("in_progress", "finalizing", "completed")
        done = wait_batch(client, batch.id, 240)
        assert done.status == "completed"
        assert done.request_counts.total == 300 and done.request_counts.completed == 300
        ids = [json.loads(x)["custom_id"] for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(ids) == sorted(f"k{i}" for i in range(300))        # each exactly once
    finally:
        node.stop()


def test_context_ingestion_skips_prefill(core, tokenizer, heldout, secret_file):
    base = f"http://127.0.0.1:{core['http']}"
    text = heldout[:1500]
    ctx = post_json(f"{base}/v1/contexts", {"text": text})
    assert ctx["id"].startswith("ctx_") and ctx["cached_tokens"] >= ctx["tokens"] - 16
    assert get_json(f"{base}/v1/contexts/{ctx['id']}")["tokens"] == ctx["tokens"]
    assert post_json(f"{base}/v1/contexts", {"text": text})["id"] == ctx["id"]   # idempotent
    # A prefill whose prompt starts with the context reuses its KV, with identical output.
    import asyncio

    from edgecore.edge.core_client import CoreClient
    from edgecore.protocol import messages as m
    from edgecore.shared.models.fingerprint import model_fingerprint
    from tests.conftest import MODEL_DIR

    prompt = tokenizer.encode(text) + tokenizer.encode(" and then the question")
    port = int(core["node"].ready_line.split("protocol 127.0.0.1:")[1].split(",")[0])

    async def prefill():
        c = CoreClient("127.0.0.1", port, secret=open(secret_file).read().strip().encode(),
                       fingerprint=model_fingerprint(MODEL_DIR), codecs=["lossless"])
        await c.connect()
        events = await c.prefill(m.PrefillRequest("ctx-use", prompt))
        while not isinstance(ev := await asyncio.wait_for(events.get(), 30), m.PrefillDone):
            pass
        await c.send(m.Ack("ctx-use"))
        await c.close()
        return ev

    done = asyncio.run(prefill())
    assert done.cached_tokens >= ctx["cached_tokens"]
    ref = make_engine().generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    assert done.first_token == ref["token_ids"][0]
    stats = get_json(f"{base}/stats")
    assert stats["contexts"] >= 1 and stats["prefix_cache_hit_tokens"] >= ctx["cached_tokens"]
    req = urllib.request.Request(f"{base}/v1/contexts/{ctx['id']}", method="DELETE")
    assert json.loads(urllib.request.urlopen(req).read())["deleted"] is True


def test_batch_submit_cli(core, tmp_path):
    import subprocess
    import sys
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([completion_line(f"cli-{i}", f"Line {i}") for i in range(4)]))
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "edgecore", "batch", "submit", str(src), "--url",
                        f"http://127.0.0.1:{core['http']}", "--endpoint", "/v1/completions", "--output", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "4 done, 0 failed of 4" in r.stderr
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == [f"cli-{i}" for i in range(4)]
    bad = subprocess.run([sys.executable, "-m", "edgecore", "batch", "submit", str(tmp_path / "nope.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
