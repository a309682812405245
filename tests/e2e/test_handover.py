"""Decode handover over real processes on loopback: the core streams the first tokens while the KV travels,
the edge takes over; output identical to single-node generation (greedy and seeded), handover points pinned
by the core's bound over a slow link (deploy/wan_relay.py), a core killed mid-stream, no leaked blocks."""

import asyncio
import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from edgecore.deploy.wan_relay import LinkSpec, WanRelay
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import get_json, post_json, start_core, start_edge, wait_for
from tests.e2e.test_disaggregated import prompts_5_to_900
from tests.e2e.test_metrics_doc import scrape, value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# A 3 Mbit/s link with a small router buffer: a 900-token prompt's KV (~1.5 MB as float32) takes 4 s, and the
# tokens the core sends go ahead of the KV still queued at the core (behind ~0.5 MB of buffers on the way).
SLOW = LinkSpec(delay_ms=5, bandwidth_mbit=3.0, buffer_bytes=64 * 1024)


class Relay:
    """deploy/wan_relay.py's relay on its own event loop thread (in front of a core)."""

    def __init__(self, spec: LinkSpec, target_port: int):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.relay = WanRelay(LinkSpec(delay_ms=spec.delay_ms), spec)     # (edge → core, core → edge)
        self.port = asyncio.run_coroutine_threadsafe(
            self.relay.start(("127.0.0.1", 0), ("127.0.0.1", target_port)), self.loop).result(10)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.relay.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def complete(http, prompt, max_tokens=24, **kw):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}
    return post_json(f"http://127.0.0.1:{http}/v1/completions", body, timeout=120)


def stats(port):
    return get_json(f"http://127.0.0.1:{port}/stats")


def books_closed(edge_http, core_http=None):
    edge = wait_for(lambda: (s := stats(edge_http))["blocks_used"] == 0 and s["handover"]["receiving"] == 0 and s)
    assert edge, stats(edge_http)
    if core_http is not None:
        core = wait_for(lambda: (s := stats(core_http))["blocks_used"] == 0 and s["remote_requests"] == 0 and s)
        assert core, stats(core_http)


@pytest.fixture(scope="module")
def cluster(secret_file):
    core, port, core_http = start_core(secret_file)
    edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
    yield {"core": core, "core_http": core_http, "edge": edge, "http": http}
    edge.stop()
    core.stop()


def test_greedy_through_handover_equals_single_node(cluster, tokenizer, heldout):
    prompts = prompts_5_to_900(tokenizer, heldout)
    ref = make_engine().generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    def ends():      # each request either handed over, or finished on the core before its KV arrived (loaded CI)
        tally = stats(cluster["http"])["handover"]
        return tally.get("handovers", 0) + tally.get("finished_before", 0)
    before = ends()
    core_before = stats(cluster["core_http"])["handover"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: complete(cluster["http"], p), prompts))
    for p, r, o in zip(prompts, ref, outs):
        assert o["choices"][0]["text"] == r["text"], f"prompt of {len(p)} tokens"
        assert o["usage"]["completion_tokens"] == 24 and o["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10      # a handover is counted once the core's DecodeStop is in, which the
    while ends() - before < len(prompts) and time.monotonic() < deadline:     # reply to the client may precede
        time.sleep(0.05)
    assert ends() - before == len(prompts)
    core_after = stats(cluster["core_http"])["handover"]
    assert core_after["decode_requests"] - core_before["decode_requests"] == len(prompts)
    books_closed(cluster["http"], cluster["core_http"])


def test_seeded_sampling_equal_with_and_without_handover(cluster, secret_file, tokenizer, heldout):
    prompts = prompts_5_to_900(tokenizer, heldout)[10:14]
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    ref = make_engine().generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True, **kw))
    with_handover = [complete(cluster["http"], p, 20, **kw)["choices"][0]["text"] for p in prompts]
    assert with_handover == [r["text"] for r in ref]
    edge, http = start_edge("--local-prefill-below", "0", "--handover-max-tokens", "0",
                            cores=[int(cluster["core"].args[2].rsplit(":", 1)[1])], secret_file=secret_file)
    try:
        before = stats(http)["handover"]
        without = [complete(http, p, 20, **kw)["choices"][0]["text"] for p in prompts]
        assert without == with_handover and stats(http)["handover"] == before    # the old mode: no handover
    finally:
        edge.stop()


@pytest.mark.parametrize("core_tokens,mbit", [(1, 3.0), (5, 3.0), (30, 1.0)])
def test_handover_points_over_a_slow_link(secret_file, tokenizer, heldout, core_tokens, mbit):
    """The core may decode `core_tokens - 1` tokens after the first; the KV over the slow link takes longer
    (30 tokens on a loaded 2-core machine take seconds: a slower link), so the edge takes over exactly at
    position `core_tokens` (measured by the edge, counted by the core)."""
    core, port, core_http = start_core(secret_file, "--handover-max-tokens", str(core_tokens - 1))
    relay = Relay(LinkSpec(SLOW.delay_ms, bandwidth_mbit=mbit, buffer_bytes=SLOW.buffer_bytes), port)
    edge, http = start_edge("--local-prefill-below", "0", cores=[relay.port], secret_file=secret_file)
    try:
        prompts = [tokenizer.encode(heldout)[1000 + 50 * i: 1900 + 50 * i] for i in range(2)]
        ref = make_engine().generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for i, (p, r) in enumerate(zip(prompts, ref)):
            before = stats(core_http)["handover"]["decoded_tokens"]
            out = complete(http, p, 40)
            assert out["choices"][0]["text"] == r["text"]
            s = stats(http)["handover"]
            assert s["last_core_tokens"] == core_tokens, s
            assert stats(core_http)["handover"]["decoded_tokens"] - before == core_tokens - 1
            metrics = scrape(http)         # the edge's metrics: every request taken over at `core_tokens`
            assert value(metrics, "edgecore:handover_requests_total", outcome="taken_over") == i + 1
            assert value(metrics, "edgecore:handover_requests_total") == i + 1
            assert value(metrics, "edgecore:handover_core_tokens_count") == i + 1
            assert value(metrics, "edgecore:handover_core_tokens_sum") == (i + 1) * core_tokens
            assert value(metrics, "edgecore:handover_tokens_received_total") == (i + 1) * (core_tokens - 1)
        books_closed(http, core_http)
    finally:
        edge.stop()
        relay.close()
        core.stop()


def one_counted_request(http, prompt, max_tokens) -> dict:
    """One greedy request through the edge, equal to single node; the edge's metrics once its handover outcome
    is counted (that waits for the core's stop, which a short reply may outlast)."""
    ref = make_engine().generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    assert complete(http, prompt, max_tokens)["choices"][0]["text"] == ref["text"]
    assert wait_for(lambda: value(scrape(http), "edgecore:handover_requests_total") == 1)
    return scrape(http)


def test_refused_is_counted(secret_file, tokenizer, heldout):
    """A core that refuses to decode (`--handover-refuse-waiting 0`: always under pressure) sends only the
    first token and the KV: counted at the edge and at the core."""
    refusing, port, core_http = start_core(secret_file, "--handover-refuse-waiting", "0")
    edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
    try:
        metrics = one_counted_request(http, tokenizer.encode(heldout)[2000:2300], 12)
        assert value(metrics, "edgecore:handover_requests_total", outcome="refused") == 1
        assert value(metrics, "edgecore:handover_tokens_received_total") == 0
        assert value(scrape(core_http), "edgecore:core_handover_refusals_total") == 1
        books_closed(http, core_http)
    finally:
        edge.stop()
        refusing.stop()


def test_finished_on_core_is_counted(secret_file, tokenizer, heldout):
    """A request that ends on tokens the core streamed (max_tokens 3; the KV takes seconds over the slow
    link) never moves: counted as finished on the core, its two streamed tokens as received."""
    core, port, core_http = start_core(secret_file)
    relay = Relay(SLOW, port)
    edge, http = start_edge("--local-prefill-below", "0", cores=[relay.port], secret_file=secret_file)
    try:
        metrics = one_counted_request(http, tokenizer.encode(heldout)[3000:3900], 3)
        assert value(metrics, "edgecore:handover_requests_total", outcome="finished_on_core") == 1
        assert value(metrics, "edgecore:handover_tokens_received_total") == 2
        assert value(metrics, "edgecore:handover_core_tokens_count") == 0       # it was never taken over
        books_closed(http, core_http)
    finally:
        edge.stop()
        relay.close()
        core.stop()


def test_parallel_core_decodes_until_the_handover(secret_file, tokenizer, heldout):
    """A TP=2 core behind the slow link: its rank 0 streams 5 tokens after the first while both ranks' KV
    travels (rank 1's on its own stream connection), the edge takes over at position 6; identical output."""
    core, port, core_http = start_core(secret_file, "--tp", "2", "--handover-max-tokens", "5")
    relay = Relay(SLOW, port)
    edge, http = start_edge("--local-prefill-below", "0", cores=[relay.port], secret_file=secret_file)
    try:
        prompt = tokenizer.encode(heldout)[1500:2400]
        ref = make_engine().generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
        assert complete(http, prompt, 30)["choices"][0]["text"] == ref["text"]
        assert stats(http)["handover"]["last_core_tokens"] == 6
        assert stats(core_http)["handover"]["decoded_tokens"] == 5
        assert value(scrape(http), "edgecore:handover_requests_total", outcome="taken_over") == 1
        books_closed(http, core_http)
    finally:
        edge.stop()
        relay.close()
        core.stop()


def stream_tokens(http, prompt, max_tokens, on_token):
    """Stream a completion; `on_token(i)` after the i-th chunk with text. Returns the whole text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, n = "", 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                text += chunk["choices"][0]["text"]
                n += 1
                on_token(n)
    return text


@pytest.mark.parametrize("kill_at", [1, 4, 12])
def test_core_killed_at_token_k_still_identical(secret_file, tokenizer, heldout, kill_at):
    """The core may decode 30 tokens, the client asks for 60: whenever the core dies after the client saw
    `kill_at` tokens, the edge (still without the whole KV) computes the rest itself."""
    core, port, core_http = start_core(secret_file, "--handover-max-tokens", "30")
    relay = Relay(SLOW, port)
    edge, http = start_edge("--local-prefill-below", "0", cores=[relay.port], secret_file=secret_file)
    try:
        prompt = tokenizer.encode(heldout)[4000:4900]
        ref = make_engine().generate([prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]

        def maybe_kill(n):
            if n == kill_at:
                core.kill()

        assert stream_tokens(http, prompt, 60, maybe_kill) == ref["text"]
        s = stats(http)["handover"]
        assert s.get("recovered", 0) == 1 and s.get("handovers", 0) == 0, s
        metrics = scrape(http)
        assert value(metrics, "edgecore:handover_requests_total", outcome="core_failed") == 1
        assert value(metrics, "edgecore:handover_requests_total") == 1
        assert value(metrics, "edgecore:core_failovers_total") == 1
        books_closed(http)
    finally:
        edge.stop()
        relay.close()
        core.kill()


def test_client_disconnect_stops_the_core_at_once(secret_file, tokenizer, heldout):
    # The bundled model decodes a token in a few milliseconds, faster than a disconnect travels (frontend →
    # engine process → Cancel through the relay) on a loaded machine, and faster than the first tokens
    # reach the client. So the core is paused (SIGSTOP) as soon as its stats show it decoding for the edge,
    # the client drops, the edge closes its side (its Cancel now waits in the core's socket), and only
    # then the core resumes: it must stop on that Cancel, far before the bound of 300 tokens it would
    # otherwise decode.
    core, port, core_http = start_core(secret_file, "--handover-max-tokens", "300")
    relay = Relay(SLOW, port)
    edge, http = start_edge("--local-prefill-below", "0", "--handover-max-tokens", "300", cores=[relay.port],
                            secret_file=secret_file)
    paused = False
    try:
        prompt = tokenizer.encode(heldout)[5000:5600]      # + 400 tokens: the model's 1024

        async def drop_while_the_core_decodes():
            nonlocal paused
            import aiohttp
            async with aiohttp.ClientSession() as s:
                async def stream():
                    async with s.post(f"http://127.0.0.1:{http}/v1/completions",
                                      json={"prompt": prompt, "max_tokens": 400, "stream": True,
                                            "ignore_eos": True}) as resp:
                        assert resp.status == 200
                        async for _ in resp.content:
                            pass
                request = asyncio.create_task(stream())
                while not (await asyncio.to_thread(stats, core_http))["decoding"]:
                    assert not request.done(), request.result()
                    await asyncio.sleep(0.005)
                os.killpg(core.proc.pid, signal.SIGSTOP)
                paused = True
                request.cancel()                   # the client goes away mid-stream
                await asyncio.gather(request, return_exceptions=True)

        asyncio.run(asyncio.wait_for(drop_while_the_core_decodes(), 60))
        assert wait_for(lambda: (s := stats(http))["blocks_used"] == 0 and s["handover"]["receiving"] == 0)
        time.sleep(0.3)                            # the Cancel crosses the relay into the core's socket
        os.killpg(core.proc.pid, signal.SIGCONT)
        paused = False
        core_stats = wait_for(lambda: (s := stats(core_http))["decoding"] == 0 and s, 10)
        assert core_stats and core_stats["handover"]["decoded_tokens"] < 200   # stopped long before its bound
        books_closed(http, core_http)
    finally:
        if paused:
            os.killpg(core.proc.pid, signal.SIGCONT)
        edge.stop()
        relay.close()
        core.stop()
