"""`edgecore up` end to end: two edge regions and one core region, official client, no orphans;
DNS discovery of cores; context prefetch to an edge."""

import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import ROOT, free_port, get_json, post_json, start_core, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children = {}
    for child, parent in zip(out[::2], out[1::2]):
        children.setdefault(int(parent), []).append(int(child))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def still_alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (not zombies), half a second after their parent stopped."""
    time.sleep(0.5)
    return [p for p in pids if os.path.exists(f"/proc/{p}") and
            "zombie" not in open(f"/proc/{p}/status").read().lower()]


def start_up(tmp_path, edges: dict[str, int], links: str = "") -> subprocess.Popen:
    """`edgecore up` on a topology of one core region `dc` and one edge region per entry of `edges` (region →
    the edge's port, the edge named edge-REGION), with `links` appended."""
    regions = "".join(f'[[regions.{region}.edges]]\nname = "edge-{region}"\nport = {port}\n'
                      for region, port in edges.items())
    topo = tmp_path / "topology.toml"
    topo.write_text(f"""
[model]
path = "{ROOT / 'models' / 'pydoc-llama'}"
[[regions.dc.cores]]
name = "core-dc"
port = {free_port()}
http_port = {free_port()}
{regions}{links}""")
    return subprocess.Popen([sys.executable, "-m", "edgecore", "up", "--topology", str(topo)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "EDGECORE_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def test_up_two_edge_regions(tmp_path, tokenizer):
    west, south = free_port(), free_port()
    proc = start_up(tmp_path, {"west": west, "south": south}, """
[[links]]
from = "west"
to = "dc"
delay_ms = 10
[[links]]
from = "south"
to = "dc"
delay_ms = 30
""")
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops everything" in line or not line:
                break
        text = "".join(lines)
        assert f"edge-west: http://127.0.0.1:{west}/v1" in text and "[dc/core-dc]" in text, text
        assert "curl http://127.0.0.1" in text
        # Keep reading `up`'s output (its nodes' echoed logs), so that a failure to stop shows the last of it.
        threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
        children = descendants(proc.pid)
        assert len(children) >= 3
        messages = [{"role": "user", "content": "What is a dictionary?"}]
        ref = make_engine().generate([tokenizer.encode_chat(messages)],
                                     SamplingParams(max_tokens=24, temperature=0))[0]["text"]
        for port in (west, south):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
            chunks = client.chat.completions.create(model="pydoc-llama", messages=messages, max_tokens=24,
                                                    temperature=0, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-60:])
        assert still_alive(children) == [], "orphans"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_starting_stops_every_node_started(tmp_path, sig):
    """SIGTERM or SIGHUP while the nodes start (here: the core is up, the edge is loading) stops what was
    started: it used to kill the launcher only, leaving the core running with nobody to stop it."""
    proc = start_up(tmp_path, {"west": free_port()})
    try:
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline and not any("[west/edge-west]" in line for line in seen):
            seen.append(proc.stdout.readline())            # the core is ready once the edge starts
        children = descendants(proc.pid)
        assert children and "Ctrl-C stops everything" not in "".join(seen), "".join(seen)
        proc.send_signal(sig)
        proc.stdout.read()
        assert proc.wait(60) != 0
        assert still_alive(children) == [], "orphans"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dns_discovery_and_context_prefetch(secret_file, tokenizer, heldout):
    http = free_port()
    core, port, core_http = start_core(secret_file, "--push-edge", f"west=http://127.0.0.1:{http}")
    edge, _ = start_edge("--local-prefill-below", "8", "--core-dns", f"localhost:{port}", "--listen",
                         f"127.0.0.1:{http}", secret_file=secret_file)
    try:
        stats = get_json(f"http://127.0.0.1:{http}/stats")
        assert any(c["address"] == f"127.0.0.1:{port}" and c["healthy"] for c in stats["cores"])
        context = tokenizer.encode(heldout[:2000])[:400]
        ctx = post_json(f"http://127.0.0.1:{core_http}/v1/contexts", {"token_ids": context})
        pushed = post_json(f"http://127.0.0.1:{core_http}/v1/contexts/{ctx['id']}/push", {"edges": ["west"]})
        result = pushed["results"][0]
        assert result["edge"] == "west" and result["status"] == 200 and result["source"] == f"127.0.0.1:{port}"
        assert result["cached_tokens"] >= 384
        prompt = context + tokenizer.encode(" What does this mean?")
        out = post_json(f"http://127.0.0.1:{http}/v1/completions",
                        {"prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 384     # only the suffix prefilled
        ref = make_engine().generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
        assert out["choices"][0]["text"] == ref["text"]
    finally:
        edge.stop()
        core.stop()
