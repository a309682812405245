"""Prefix-aware routing across two real cores: each core's digests reach the edge, and a prompt goes to the core
whose prefix cache holds its prefix, whichever is nearer; `cached_tokens` reports what that core did not compute.
Each core is warmed with a different prefix (a context pinned through its control port), so only routing by
prefix can send both continuations where their prefixes are."""

import time

import pytest

from tests.e2e.procs import get_json, metric, post_json, start_core, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_each_prompt_goes_to_the_core_holding_its_prefix(secret_file, tokenizer, heldout):
    ids = tokenizer.encode(heldout)
    prefixes = {"a": ids[1000:1320], "b": ids[2000:2320]}
    core_a, port_a, http_a = start_core(secret_file)
    core_b, port_b, http_b = start_core(secret_file)
    edge, http = start_edge("--local-prefill-below", "0", cores=[port_a, port_b], secret_file=secret_file)
    try:
        for core_http, name in ((http_a, "a"), (http_b, "b")):
            post_json(f"http://127.0.0.1:{core_http}/v1/contexts", {"token_ids": prefixes[name]})
        deadline = time.monotonic() + 30           # digests every 0.5 s
        while True:
            cores = get_json(f"http://127.0.0.1:{http}/stats")["cores"]
            if all((c["prefix_digest"] or {}).get("blocks", 0) >= 20 for c in cores):
                break
            assert time.monotonic() < deadline, cores
            time.sleep(0.2)
        hits = {}
        for name, turn in (("a", ids[1320:1350]), ("b", ids[2320:2350]), ("a", ids[5000:5040])):
            before = {n: get_json(f"http://127.0.0.1:{h}/stats")["prefix_cache_hit_tokens"]
                      for n, h in (("a", http_a), ("b", http_b))}
            out = post_json(f"http://127.0.0.1:{http}/v1/completions",
                            {"prompt": prefixes[name] + turn, "max_tokens": 4, "temperature": 0})
            after = {n: get_json(f"http://127.0.0.1:{h}/stats")["prefix_cache_hit_tokens"]
                     for n, h in (("a", http_a), ("b", http_b))}
            hits[name] = hits.get(name, 0) + out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert after[name] - before[name] == 320, (name, before, after)       # 20 blocks of 16, all there
            assert after[other(name)] == before[other(name)]
        assert hits == {"a": 640, "b": 320}
        assert metric(http, "edgecore:core_prefix_hit_tokens_total") == 960
        assert metric(http, "edgecore:core_prefill_predicted_seconds_count") == 3
    finally:
        edge.stop()
        core_a.stop()
        core_b.stop()


def other(name: str) -> str:
    return "b" if name == "a" else "a"
