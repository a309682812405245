"""Core → edge over real processes on loopback: identical to single-node, failover, cancel, refusals."""

import asyncio
import concurrent.futures
import json

import pytest

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import get_json, metric, post_json, start_core, start_edge, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(secret_file):
    core, port, core_http = start_core(secret_file)
    edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
    yield {"core": core, "core_http": core_http, "edge": edge, "http": http, "port": port}
    edge.stop()
    core.stop()


def prompts_5_to_900(tokenizer, heldout):
    lengths = [5, 9, 17, 33, 48, 64, 80, 100, 130, 170, 220, 280, 350, 420, 500, 580, 660, 740, 820, 900]
    ids = tokenizer.encode(heldout)
    return [ids[i * 40: i * 40 + n] for i, n in enumerate(lengths)]


def complete(http, prompt, max_tokens=24, **kw):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}
    return post_json(f"http://127.0.0.1:{http}/v1/completions", body)


def test_lossless_equals_single_node(cluster, tokenizer, heldout):
    prompts = prompts_5_to_900(tokenizer, heldout)
    shared = prompts[-1][:300]
    prompts += [shared + tokenizer.encode(s) for s in (" first branch", " second one", " and a third")]
    ref = make_engine().generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    before = metric(cluster["http"], 'edgecore:remote_prefills_total{codec="lossless"')
    with concurrent.futures.ThreadPoolExecutor(8) as pool:   # 8 concurrent requests at a time
        outs = list(pool.map(lambda p: complete(cluster["http"], p), prompts))
    for p, r, o in zip(prompts, ref, outs):
        assert o["choices"][0]["text"] == r["text"], f"prompt of {len(p)} tokens"
    after = metric(cluster["http"], 'edgecore:remote_prefills_total{codec="lossless"')
    assert after - before == len(prompts)            # all went through the core
    assert get_json(f"http://127.0.0.1:{cluster['http']}/stats")["blocks_used"] == 0
    core = wait_for(lambda: (s := get_json(f"http://127.0.0.1:{cluster['core_http']}/stats"))["leases"] == 0 and s)
    assert core["blocks_used"] == 0 and core["remote_requests"] == 0


def test_lossy_codec_where_allowed(secret_file, tokenizer, heldout):
    core, port, _ = start_core(secret_file)
    edge, http = start_edge("--local-prefill-below", "0", "--codec", "int8", cores=[port], secret_file=secret_file)
    try:
        ids = tokenizer.encode(heldout)[:400]
        out = complete(http, ids, 16)
        assert out["choices"][0]["finish_reason"] == "length"
        assert metric(http, 'edgecore:remote_prefills_total{codec="int8"') == 1
        assert metric(http, 'edgecore:kv_compression_ratio{codec="int8"') > 1.5
    finally:
        edge.stop()
        core.stop()


def test_core_killed_mid_transfer_still_completes(secret_file, tokenizer, heldout):
    core, port, core_http = start_core(secret_file, "--max-batched-tokens", "16")
    edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
    try:
        prompt = tokenizer.encode(heldout)[2000:2900]
        ref = make_engine().generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, http, prompt)
            assert wait_for(lambda: get_json(f"http://127.0.0.1:{core_http}/stats")["remote_requests"] > 0, 20,
                            0.005)
            core.kill()
            out = fut.result(120)
        assert out["choices"][0]["text"] == ref["text"]
        assert metric(http, "edgecore:local_prefills_total") >= 1   # fell back after the core died
        stats = wait_for(lambda: (s := get_json(f"http://127.0.0.1:{http}/stats"))["blocks_used"] == 0 and s)
        assert stats["blocks_used"] == 0 and stats["cores"][0]["healthy"] is False
    finally:
        edge.stop()
        core.kill()


def test_cancel_frees_blocks_on_both_sides(secret_file, tokenizer, heldout):
    core, port, core_http = start_core(secret_file, "--max-batched-tokens", "16")
    edge, http = start_edge("--local-prefill-below", "0", cores=[port], secret_file=secret_file)
    try:
        prompt = tokenizer.encode(heldout)[3000:3900]

        async def start_and_drop():
            import aiohttp
            async with aiohttp.ClientSession() as s:
                resp = await s.post(f"http://127.0.0.1:{http}/v1/completions",
                                    json={"prompt": prompt, "max_tokens": 500, "stream": True, "ignore_eos": True})
                for _ in range(400):
                    stats = get_json(f"http://127.0.0.1:{core_http}/stats")
                    if stats["remote_requests"] > 0:
                        break
                    await asyncio.sleep(0.005)
                resp.close()      # client goes away while the core is still prefilling

        asyncio.run(start_and_drop())
        core_stats = wait_for(lambda: (s := get_json(f"http://127.0.0.1:{core_http}/stats"))["blocks_used"] == 0
                              and s["remote_requests"] == 0 and s)
        assert core_stats and core_stats["blocks_used"] == 0
        edge_stats = wait_for(lambda: (s := get_json(f"http://127.0.0.1:{http}/stats"))["blocks_used"] == 0 and s)
        assert edge_stats and edge_stats["requests"] == 0
    finally:
        edge.stop()
        core.stop()


def test_wrong_secret_or_model_is_refused(secret_file, tmp_path, model_dir):
    import shutil
    core, port, core_http = start_core(secret_file)
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("not-the-secret")
    other_model = tmp_path / "other-model"
    shutil.copytree(model_dir, other_model)
    cfg = json.loads((other_model / "config.json").read_text())
    cfg["rope_theta"] = 20000.0
    (other_model / "config.json").write_text(json.dumps(cfg))
    try:
        for extra, secret, needle in (([], str(wrong), "authentication failed"),
                                      (["--model", str(other_model)], secret_file, "model mismatch")):
            edge, http = start_edge(*extra, cores=[port], secret_file=secret)
            try:
                stats = get_json(f"http://127.0.0.1:{http}/stats")
                assert stats["cores"][0]["healthy"] is False and needle in stats["cores"][0]["error"]
                # The edge still answers, prefilling locally.
                assert complete(http, "The with statement", 4)["choices"][0]["finish_reason"] == "length"
            finally:
                edge.stop()
        assert "refused" in core.logs() and "wrong cluster secret" in core.logs()
        assert "model mismatch" in core.logs()
    finally:
        core.stop()
