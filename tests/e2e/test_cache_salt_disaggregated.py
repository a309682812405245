"""Prefix caches scoped by tenant across the link: an edge with salted API keys prefills at a core, whose
prefix cache is scoped by the PrefillRequest's `cache_salt` as the edge's is by the request's salt. Real
processes on loopback."""

import pytest

from tests.e2e.procs import get_json, metric, post_json, start_core, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_tenants_never_share_cached_kv_at_the_edge_or_the_core(secret_file, tmp_path, tokenizer, heldout):
    keys = tmp_path / "keys"
    keys.write_text("sk-acme salt=acme\nsk-beta salt=beta\nsk-open\n")
    core, port, core_http = start_core(secret_file)
    edge, http = start_edge("--local-prefill-below", "0", "--api-key-file", str(keys), cores=[port],
                            secret_file=secret_file)
    try:
        prompt = tokenizer.encode(heldout)[500:700]

        def complete(key: str, salt: str | None = None) -> tuple[str, int, int]:
            """(text, cached tokens at the edge, prompt tokens the core found cached meanwhile)."""
            before = get_json(f"http://127.0.0.1:{core_http}/stats")["prefix_cache_hit_tokens"]
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            if salt is not None:
                body["cache_salt"] = salt
            out = post_json(f"http://127.0.0.1:{http}/v1/completions", body,
                            headers={"Authorization": f"Bearer {key}"})
            after = get_json(f"http://127.0.0.1:{core_http}/stats")["prefix_cache_hit_tokens"]
            return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"], after - before

        text, edge_hit, core_hit = complete("sk-acme")
        assert (edge_hit, core_hit) == (0, 0)
        for key, salt in (("sk-beta", None), ("sk-open", None), ("sk-open", "acme"), ("sk-acme", "other")):
            assert complete(key, salt) == (text, 0, 0), (key, salt)      # another scope: no hit on either side
        again, edge_hit, core_hit = complete("sk-acme")
        assert again == text and edge_hit > 0 and core_hit > 0            # the same tenant hits on both
        assert metric(http, "edgecore:remote_prefills_total") == 6        # every one went through the core
    finally:
        edge.stop()
        core.stop()
