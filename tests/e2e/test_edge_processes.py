"""The edge as two processes (HTTP frontend + engine process): neither outlives the other, and a
dead engine ends open streams with an error instead of a hang. `--engine-in-process` still serves."""

import http.client
import json
import os
import signal
from pathlib import Path

import pytest

from tests.e2e.procs import get_json, post_json, start_edge, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a zombie child of the frontend counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def open_stream(port: int) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "pydoc-llama", "prompt": "def parse(text):", "max_tokens": 900, "temperature": 0,
        "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")        # tokens are flowing
    return resp


def test_a_dead_engine_process_ends_streams_and_the_frontend():
    edge, port = start_edge()
    try:
        engine_pid = get_json(f"http://127.0.0.1:{port}/stats")["engine_pid"]
        assert engine_pid != edge.proc.pid and alive(engine_pid)
        resp = open_stream(port)
        os.kill(engine_pid, signal.SIGKILL)
        rest = resp.read()                      # ends (error event or closed connection), never hangs
        assert b"[DONE]" not in rest or b'"error"' in rest
        assert edge.proc.wait(20) == 1          # the frontend shuts down, non-zero, for a supervisor
    finally:
        edge.stop()


def test_the_engine_process_does_not_outlive_its_frontend():
    edge, port = start_edge()
    try:
        engine_pid = get_json(f"http://127.0.0.1:{port}/stats")["engine_pid"]
        os.kill(edge.proc.pid, signal.SIGKILL)  # only the frontend, not the process group
        edge.proc.wait(10)
        assert wait_for(lambda: not alive(engine_pid), timeout=20)
    finally:
        edge.kill()


def test_engine_in_process_still_serves():
    edge, port = start_edge("--engine-in-process")
    try:
        out = post_json(f"http://127.0.0.1:{port}/v1/completions",
                        {"model": "pydoc-llama", "prompt": "import os", "max_tokens": 5, "temperature": 0})
        assert out["usage"]["completion_tokens"] == 5
        assert "engine_pid" not in get_json(f"http://127.0.0.1:{port}/stats")
    finally:
        edge.stop()


def mapped_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def write_adapter(path: Path) -> Path:
    """A PEFT LoRA adapter (q_proj and down_proj, r=2) for the bundled model: 192 hidden, 192 query, 512 MLP."""
    import torch
    from safetensors.torch import save_file
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    weights = {}
    for layer in range(4):
        for where, proj, fan_in, fan_out in (("self_attn", "q_proj", 192, 192), ("mlp", "down_proj", 512, 192)):
            key = f"base_model.model.model.layers.{layer}.{where}.{proj}"
            weights[f"{key}.lora_A.weight"] = torch.randn(2, fan_in) * 0.1
            weights[f"{key}.lora_B.weight"] = torch.randn(fan_out, 2) * 0.1
    save_file(weights, path / "adapter_model.safetensors")
    return path


def test_the_frontend_never_loads_torch_and_the_engine_says_what_kv_it_holds(tmp_path):
    """The HTTP process stays small: it checks a --lora adapter's files and serves plain, adapter, sampled,
    streamed and structured-output requests without torch ever mapped into it (all tensor work is in the
    engine process). The engine's start-up log states the KV cache that --kv-cache-memory gave it."""
    edge, port = start_edge("--kv-cache-memory", "64MiB", "--lora", f"tiny={write_adapter(tmp_path / 'tiny')}")
    try:
        engine_pid = get_json(f"http://127.0.0.1:{port}/stats")["engine_pid"]
        base = f"http://127.0.0.1:{port}/v1"
        post_json(f"{base}/completions", {"model": "pydoc-llama", "prompt": "import os", "max_tokens": 4})
        assert post_json(f"{base}/completions", {"model": "tiny", "prompt": "import os", "max_tokens": 4}
                         )["usage"]["completion_tokens"] == 4
        post_json(f"{base}/chat/completions", {
            "model": "pydoc-llama", "messages": [{"role": "user", "content": "a name"}], "max_tokens": 24,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}})
        post_json(f"{base}/completions", {"model": "pydoc-llama", "prompt": "def f(x):", "max_tokens": 8,
                                          "logprobs": 2, "stop": ["\n\n"], "seed": 3, "temperature": 0.8})
        open_stream(port).close()
        assert "libtorch" in mapped_libraries(engine_pid)          # the check can see torch where it is
        assert "libtorch" not in mapped_libraries(edge.proc.pid)
        # 64 MiB at 2,048 bytes per token (4 layers x 2 x 2 heads x 32 x 4 bytes, fp32) = 2,048 blocks of 16
        assert "KV cache: 2048 blocks of 16 tokens = 32,768 tokens, 64.0 MiB" in edge.logs()
        assert get_json(f"http://127.0.0.1:{port}/stats")["blocks_total"] == 2048
    finally:
        edge.stop()
