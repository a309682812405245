"""An edge restarted on the same `--kv-tier-dir` serves its previous prefixes from the disk tier: the flags
reach the engine process, the blocks still cached are written when the edge stops, and the next run reads them
back (same text; `usage.prompt_tokens_details.cached_tokens` and the tier's metrics say so)."""

from __future__ import annotations

import pytest

from tests.e2e.procs import metric, post_json, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = [(11 * j) % 1900 + 50 for j in range(100)]       # six full blocks, the last token recomputed


def complete(http: int) -> dict:
    return post_json(f"http://127.0.0.1:{http}/v1/completions",
                     {"model": "pydoc-llama", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})


def test_a_restarted_edge_serves_its_previous_prefixes_from_the_tier(tmp_path):
    flags = ("--kv-tier-dir", str(tmp_path / "tier"), "--kv-tier-size", "16MiB", "--kv-blocks", "64")
    edge, http = start_edge(*flags)
    try:
        first = complete(http)
    finally:
        edge.stop()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(list((tmp_path / "tier").glob("*.kvb"))) >= 6      # written at shutdown
    edge, http = start_edge(*flags)
    try:
        second = complete(http)
        hits = metric(http, "edgecore:kv_tier_hit_blocks_total")
        healthy = metric(http, "edgecore:kv_tier_healthy")
    finally:
        edge.stop()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96 and hits == 6 and healthy == 1
