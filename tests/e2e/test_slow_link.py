"""Latency-critical frames on a slow link (docs/wire-format.md §5a, "Latency-critical frames"): behind the
bounded-queue relay (deploy/wan_relay.py: a 64 KiB router queue, the link's rate), a decode handover's first
token reaches the client long before the KV has crossed. Both instants are measured in the same run: the
first streamed token's arrival, and the edge's handover (sent once the last KV chunk is in)."""

import json
import threading
import time
import urllib.request

import pytest

from edgecore.deploy.wan_relay import LinkSpec
from tests.e2e.procs import metric, start_core, start_edge
from tests.e2e.test_handover import Relay, stats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# 4 Mbit/s, 20 ms one way, a 64 KiB queue at the bottleneck: a 900-token prompt's KV (~1.5 MB) needs ~3 s.
LINK = LinkSpec(delay_ms=20, bandwidth_mbit=4.0, buffer_bytes=64 * 1024)


def stream_first_token(http: int, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(when the request left, when its first token arrived, tokens streamed)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    sent, first, count = time.monotonic(), None, 0
    with urllib.request.urlopen(req, timeout=90) as r:
        for line in r:
            if line.startswith(b"data: {"):
                if first is None:
                    first = time.monotonic()
                count += 1
    assert first is not None
    return sent, first, count


def test_first_token_before_the_kv_crossed(secret_file, tokenizer, heldout):
    core, port, core_http = start_core(secret_file, "--handover-max-tokens", "200")
    relay = Relay(LINK, port)
    edge, http = start_edge("--local-prefill-below", "0", cores=[relay.port], secret_file=secret_file)
    handed: list[float] = []
    done = threading.Event()

    def watch() -> None:            # the edge's Handover: sent once every KV chunk has arrived
        base = stats(http)["handover"].get("handovers", 0)
        while not done.is_set() and not handed:
            if stats(http)["handover"].get("handovers", 0) > base:
                handed.append(time.monotonic())
            time.sleep(0.005)
    try:
        prompt = tokenizer.encode(heldout)[2000:2900]
        stream_first_token(http, tokenizer.encode(heldout)[:64], 4)      # warm: connection, edge engine
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        prefill_before = metric(core_http, "edgecore:core_prefill_seconds_sum")
        sent, first, count = stream_first_token(http, prompt, 120)
        prefill = metric(core_http, "edgecore:core_prefill_seconds_sum") - prefill_before
        watcher.join(30)
        assert handed, "the edge never handed over (did the request end on the core's tokens?)"
        kv_end = handed[0]
        # After the core's prefill, the KV still needed at least 300 ms on the link; the first token's own wait
        # beyond the prefill (its trip and whatever it queued behind) ended well before it: at most half of it.
        seen = {"first_token_s": first - sent, "kv_end_s": kv_end - sent, "core_prefill_s": prefill, "tokens": count}
        kv_after_prefill, token_after_prefill = kv_end - sent - prefill, first - sent - prefill
        assert kv_after_prefill >= 0.3, seen
        assert token_after_prefill < 0.5 * kv_after_prefill, seen
    finally:
        done.set()
        edge.stop()
        relay.close()
        core.stop()
