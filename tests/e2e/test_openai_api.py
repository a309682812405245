"""The official `openai` client against a running edge, with and without a core; hostile HTTP input."""

import asyncio
import json
import socket
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import get_json, start_core, start_edge, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
KEY = "sk-edge-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}          # /stats needs the key like /v1/


@pytest.fixture(scope="module", params=["with-core", "edge-only"])
def server(request, secret_file, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# test keys\n{KEY}\nsk-second\n")
    core = core_http = None
    if request.param == "with-core":
        core, port, core_http = start_core(secret_file)
        edge, http = start_edge("--api-key-file", str(keys), "--local-prefill-below", "0", "--max-body-mb", "1",
                                cores=[port], secret_file=secret_file)
    else:
        edge, http = start_edge("--api-key-file", str(keys), "--max-body-mb", "1")
    yield {"http": http, "mode": request.param, "core_http": core_http}
    edge.stop()
    if core:
        core.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['http']}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_and_completion_match_engine(client, golden):
    assert [m.id for m in client.models.list().data] == ["pydoc-llama"]
    case = golden["cases"][0]
    r = client.completions.create(model="pydoc-llama", prompt=case["prompt"], max_tokens=64, temperature=0)
    assert r.choices[0].text == case["greedy_text"]
    assert r.usage.prompt_tokens == len(case["prompt_ids"]) and r.usage.completion_tokens == 64
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    r = client.completions.create(model="pydoc-llama", prompt=case["prompt_ids"], max_tokens=8, temperature=0,
                                  echo=True)
    assert r.choices[0].text.startswith(case["prompt"])


def test_chat_matches_engine(client, tokenizer):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a tuple?"}]
    ids = tokenizer.encode_chat(messages)
    ref = make_engine().generate([ids], SamplingParams(max_tokens=20, temperature=0))[0]
    r = client.chat.completions.create(model="pydoc-llama", messages=messages, max_completion_tokens=20,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]


def test_streaming_with_usage(client):
    kw = dict(model="pydoc-llama", messages=[{"role": "user", "content": "Explain the for statement."}],
              max_tokens=30, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    comp = list(client.completions.create(model="pydoc-llama", prompt="The module", max_tokens=12, temperature=0,
                                          stream=True, stream_options={"include_usage": True}))
    assert comp[-1].usage.total_tokens == comp[-1].usage.prompt_tokens + 12


def test_stop_sequences(client, golden):
    case = golden["cases"][0]
    stop = case["greedy_text"][25:31]
    r = client.completions.create(model="pydoc-llama", prompt=case["prompt"], max_tokens=64, temperature=0,
                                  stop=[stop, "zzz-never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == case["greedy_text"][:case["greedy_text"].index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="pydoc-llama", prompt=case["prompt"], max_tokens=64, temperature=0, stop=stop, stream=True)
        if c.choices)
    assert streamed == r.choices[0].text


def test_n_and_seed(client):
    kw = dict(model="pydoc-llama", prompt="The class", max_tokens=16, temperature=1.0, seed=42, n=2)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert len(a.choices) == 2 and sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    chat = client.chat.completions.create(model="pydoc-llama", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=10, n=2, temperature=0.8, seed=1)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens <= 20


def test_logprobs(client):
    r = client.chat.completions.create(model="pydoc-llama", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)   # greedy: chosen = top
    c = client.completions.create(model="pydoc-llama", prompt="The class", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs[0]) == 2 and "".join(lp.tokens) == c.choices[0].text


def test_error_mapping(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="pydoc-llama", prompt="x", max_tokens=5000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="pydoc-llama", messages=[{"role": "user", "content": "x " * 1100}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="pydoc-llama", prompt="x", temperature=5)
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server['http']}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.body["code"] == "invalid_api_key"


def raw_request(port, payload: bytes, content_type="application/json", key=KEY, method="POST",
                path="/v1/completions"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=payload, method=method,
                                 headers={"Content-Type": content_type, "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("payload, ctype, status", [
    (b'{"prompt": "x", "max_tokens": 2', "application/json", 400),            # malformed JSON
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "application/json", 400),      # invalid UTF-8
    (b'{"prompt": "x", "max_tokens": 1e400}', "application/json", 400),         # huge number
    (b'{"prompt": "x", "max_tokens": 99999999999999999999999}', "application/json", 400),
    (b'{"prompt": "x", "max_tokens": -3}', "application/json", 400),
    (b'{"prompt": "x", "max_tokens": 2, "n": 1000000000}', "application/json", 400),
    (b'{"prompt": 5}', "application/json", 400),                                # wrong type
    (b'["not", "an", "object"]', "application/json", 400),
    (b'prompt=x', "application/x-www-form-urlencoded", 415),
])
def test_hostile_input_gets_4xx_and_server_keeps_serving(server, client, payload, ctype, status):
    code, body = raw_request(server["http"], payload, ctype)
    assert code == status and set(body["error"]) >= {"message", "type", "param", "code"}
    assert client.completions.create(model="pydoc-llama", prompt="ok", max_tokens=2).choices


def test_huge_body_is_413_json(server, client):
    big = b'{"prompt": "' + b"a" * (50 * 1024 * 1024) + b'"}'
    sock = socket.create_connection(("127.0.0.1", server["http"]), timeout=30)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(big)}\r\n\r\n").encode()
    sock.sendall(head)
    try:
        sock.sendall(big)
    except (BrokenPipeError, ConnectionResetError):
        pass     # the server may answer and close before the whole body is sent
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        data = sock.recv(65536)
        if not data:
            break
        reply += data
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in reply
    assert client.completions.create(model="pydoc-llama", prompt="ok", max_tokens=2).choices


def test_disconnect_mid_stream_frees_blocks_and_metrics_move(server):
    port = server["http"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    before = {s.name + str(s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples}

    async def drop():
        import aiohttp
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            resp = await s.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"prompt": "The", "max_tokens": 900, "stream": True, "ignore_eos": True})
            await resp.content.readline()
            await resp.content.readline()
            assert get_json(f"http://127.0.0.1:{port}/stats", headers=AUTH)["blocks_used"] > 0
            resp.close()

    asyncio.run(drop())
    stats = wait_for(lambda: (s := get_json(f"http://127.0.0.1:{port}/stats", headers=AUTH))["blocks_used"] == 0
                     and s["requests"] == 0 and s)
    assert stats and stats["blocks_used"] == 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    after = {s.name + str(s.labels): s.value for f in families.values() for s in f.samples}
    assert "edgecore:time_to_first_token_seconds" in families
    label = str({"model_name": "pydoc-llama"})
    assert after["edgecore:generation_tokens_total" + label] > before["edgecore:generation_tokens_total" + label]
    assert after["edgecore:time_to_first_token_seconds_count" + label] > \
        before["edgecore:time_to_first_token_seconds_count" + label]


def test_64_simultaneous_streams(server):
    port = server["http"]

    async def one(s, i):
        resp = await s.post(f"http://127.0.0.1:{port}/v1/completions",
                            json={"prompt": f"Request {i}: the", "max_tokens": 16, "stream": True,
                                  "ignore_eos": True, "temperature": 0})
        assert resp.status == 200
        chunks = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
        return chunks

    async def main():
        import aiohttp
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"},
                                         connector=aiohttp.TCPConnector(limit=100)) as s:
            return await asyncio.gather(*(one(s, i) for i in range(64)))

    counts = asyncio.run(main())
    assert len(counts) == 64 and all(c >= 1 for c in counts)
    assert get_json(f"http://127.0.0.1:{port}/stats", headers=AUTH)["blocks_used"] == 0


# ---- sampling parameters: each changes the output as it should, equal to a single-node run ------------------
REPETITIVE = "for x in range(10): for x in range(10): for x in range(10): for x in"


def single_node(prompt_ids, **kw):
    kw.setdefault("temperature", 0)
    return make_engine().generate([prompt_ids], SamplingParams(**kw))[0]


def test_logit_bias_bans_the_greedy_token(client, tokenizer):
    ids = tokenizer.encode(REPETITIVE)
    greedy = single_node(ids, max_tokens=6)["token_ids"]
    r = client.completions.create(model="pydoc-llama", prompt=ids, max_tokens=6, temperature=0,
                                  logit_bias={str(greedy[0]): -100})
    ref = single_node(ids, max_tokens=6, logit_bias={greedy[0]: -100.0})
    assert ref["token_ids"][0] != greedy[0] and greedy[0] not in ref["token_ids"]
    assert r.choices[0].text == ref["text"]
    forced = client.completions.create(model="pydoc-llama", prompt=ids, max_tokens=3, temperature=0,
                                       logit_bias={"65": 100})
    assert forced.choices[0].text == tokenizer.decode([65, 65, 65])


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5},
                                     {"repetition_penalty": 1.8}])
def test_penalties_change_a_repetitive_continuation(client, tokenizer, penalty):
    ids = tokenizer.encode(REPETITIVE)
    plain = single_node(ids, max_tokens=24)
    ref = single_node(ids, max_tokens=24, **penalty)
    assert ref["text"] != plain["text"]
    r = client.completions.create(model="pydoc-llama", prompt=REPETITIVE, max_tokens=24, temperature=0,
                                  extra_body=penalty)
    assert r.choices[0].text == ref["text"]
    chat = client.chat.completions.create(model="pydoc-llama", max_tokens=16, temperature=0,
                                          messages=[{"role": "user", "content": REPETITIVE}], extra_body=penalty)
    ref = single_node(tokenizer.encode_chat([{"role": "user", "content": REPETITIVE}]), max_tokens=16, **penalty)
    assert chat.choices[0].message.content == ref["text"]


def test_min_p_one_is_greedy(client):
    kw = dict(model="pydoc-llama", prompt="The class statement", max_tokens=16)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    for seed in (1, 2, 3):
        r = client.completions.create(**kw, temperature=1.5, seed=seed, extra_body={"min_p": 1.0})
        assert r.choices[0].text == greedy


def test_best_of_returns_the_most_likely_sample(client):
    kw = dict(model="pydoc-llama", prompt="A module is", max_tokens=10, temperature=1.2, seed=11)
    every = client.completions.create(**kw, n=4, logprobs=0)
    cumulative = [sum(c.logprobs.token_logprobs) for c in every.choices]
    assert len(set(c.text for c in every.choices)) > 1
    best = client.completions.create(**kw, n=1, best_of=4)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == every.choices[cumulative.index(max(cumulative))].text
    assert best.usage.completion_tokens == every.usage.completion_tokens
    two = client.completions.create(**kw, n=2, best_of=4)
    ranked = sorted(range(4), key=lambda i: -cumulative[i])[:2]
    assert [c.text for c in two.choices] == [every.choices[i].text for i in ranked]


def test_echo_with_logprobs_gives_prompt_logprobs(client, tokenizer, hf_model):
    import torch
    prompt = "The for statement is used to"
    ids = tokenizer.encode(prompt)
    r = client.completions.create(model="pydoc-llama", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.token_logprobs) == len(ids) - 1 + 4 and len(lp.top_logprobs[0]) == 2
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p - 1] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-3)
    extra = client.completions.create(model="pydoc-llama", prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 0})
    plps = extra.choices[0].model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(ids)
    assert plps[1][str(ids[1])]["logprob"] == pytest.approx(ref[0, ids[1]].item(), abs=1e-3)


@pytest.mark.parametrize("kw, param", [
    ({"extra_body": {"response_format": {"type": "made-up"}}}, "response_format.type"),
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}},
     "response_format.json_schema"),
    ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}}, "tools"),
    ({"extra_body": {"tool_choice": "required"}}, "tool_choice"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"guided_regex": "[a-z"}}, "guided_regex"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice"),
    ({"extra_body": {"min_p": 5}}, "min_p"),
    ({"extra_body": {"stop_token_ids": 5}}, "stop_token_ids"),
    ({"extra_body": {"top_k": 1e30}}, "top_k"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                 "image_url": {"url": "x"}}]}]}},
     "messages[0].content[0]"),
])
def test_rejected_chat_parameters_name_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="pydoc-llama", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, **kw)
    assert e.value.body["param"] == param and e.value.status_code == 400


@pytest.mark.parametrize("kw, param", [
    ({"suffix": "def f():"}, "suffix"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"), ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"extra_body": {"min_tokens": 4}}, "min_tokens"), ({"logprobs": 9}, "logprobs"),
])
def test_rejected_completion_parameters_name_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="pydoc-llama", prompt="x", max_tokens=2, **kw)
    assert e.value.body["param"] == param


def test_tokenize_version_and_model_routes(server, client, tokenizer):
    port = server["http"]
    body = json.dumps({"prompt": "The with statement"}).encode()
    code, tokens = raw_request(port, body, path="/tokenize")
    assert code == 200 and tokens["tokens"] == tokenizer.encode("The with statement")
    code, text = raw_request(port, json.dumps({"tokens": tokens["tokens"]}).encode(), path="/detokenize")
    assert code == 200 and text["prompt"] == "The with statement"
    assert get_json(f"http://127.0.0.1:{port}/version")["version"]
    assert client.models.retrieve("pydoc-llama").id == "pydoc-llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    if server["core_http"]:
        core = openai.OpenAI(base_url=f"http://127.0.0.1:{server['core_http']}/v1", api_key="unused",
                             max_retries=0, timeout=30)
        assert [m.id for m in core.models.list().data] == ["pydoc-llama"]
