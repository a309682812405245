"""Edge metrics: an engine failure inside a started stream is counted; per-request histograms; model_name."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edgecore.edge.metrics import EdgeMetrics
from edgecore.shared.engine.handle import EngineStats
from edgecore.shared.errors import EngineDead
from edgecore.shared.node.metrics import ITERATION_TOKEN_BUCKETS, Buckets
from tests.edge.test_http_hardening import engine, post_raw, server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(60)


async def test_a_500_inside_a_stream_is_counted(server):  # noqa: F811
    real = server["edge"].generate

    async def dies(rid, prompt, params, group=None, cache_salt=None):
        async for out in real(rid, prompt, params):
            yield out
            raise EngineDead("the engine process exited")
    server["edge"].generate = dies
    before = len(server["edge"].errors)
    status, _, raw = await post_raw(server["session"], "/v1/completions",
                                    b'{"prompt": "The class", "max_tokens": 8, "stream": true}')
    assert status == 200 and b'"code":"internal_error"' in raw.replace(b" ", b"")
    assert server["edge"].errors[before:] == ["500"]


def _samples(metrics: EdgeMetrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
            assert s.labels["model_name"] == "m1", s
    return out


def test_engine_counts_come_from_the_stats_snapshot():
    steps = Buckets()
    for n in (1, 1, 7, 300, 20000):
        steps.observe(n)
    stats = EngineStats(preemptions=3, prefix_cache_query_tokens=64, prefix_cache_hit_tokens=48, blocks_total=99,
                        iteration_tokens=tuple(steps.counts), iteration_tokens_sum=steps.total, prefix_caching=True)
    m = EdgeMetrics("m1", lambda: stats, 16)
    m.requests.labels("stop").inc()
    s = _samples(m)
    assert s[("edgecore:num_preemptions_total", ())] == 3
    assert s[("edgecore:prefix_cache_queries_total", ())] == 64 and s[("edgecore:prefix_cache_hits_total", ())] == 48
    assert s[("edgecore:iteration_tokens_count", ())] == 5 and s[("edgecore:iteration_tokens_sum", ())] == 20309
    assert s[("edgecore:iteration_tokens_bucket", (("le", "1.0"),))] == 2
    assert s[("edgecore:iteration_tokens_bucket", (("le", "8.0"),))] == 3
    assert s[("edgecore:iteration_tokens_bucket", (("le", "16384.0"),))] == 4
    assert s[("edgecore:iteration_tokens_bucket", (("le", "+Inf"),))] == 5
    info = [k for k in s if k[0] == "edgecore:cache_config_info"]
    assert info == [("edgecore:cache_config_info", (("block_size", "16"), ("enable_prefix_caching", "true"),
                                                    ("num_gpu_blocks", "99")))]
    assert s[("edgecore:request_success_total", (("finished_reason", "stop"),))] == 1
    assert len(steps.counts) == len(ITERATION_TOKEN_BUCKETS) + 1


def test_engine_step_feeds_the_iteration_histogram(tokenizer):
    from tests.conftest import make_engine
    eng = make_engine(budget=2048)
    from edgecore.shared.engine.sampling_params import SamplingParams
    eng.generate([tokenizer.encode("The for statement")], SamplingParams(max_tokens=4, temperature=0))
    stats = eng.stats()
    prompt = len(tokenizer.encode("The for statement"))
    assert stats.iteration_tokens_sum == prompt + 3 and sum(stats.iteration_tokens) == 4
