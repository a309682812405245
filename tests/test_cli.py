"""The `edgecore` command: help everywhere, streamed generation, one-line errors."""

import subprocess
import sys

import pytest

from tests.conftest import MODEL_DIR


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "edgecore", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_streams_the_golden_continuation(golden):
    case = golden["cases"][0]
    r = run("generate", "--prompt", case["prompt"], "--max-tokens", "64")
    assert r.returncode == 0, r.stderr
    assert r.stdout == case["prompt"] + case["greedy_text"] + "\n"


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", "x", "--model", "/nonexistent"], "config.json"),
    (["generate", "--prompt", "x " * 1200], "context length"),
    (["generate", "--prompt", "x", "--temperature", "-3"], "temperature"),
    (["generate", "--prompt", "x", "--device", "tpu-ish"], "unknown device"),
    (["edge", "--kv-cache-memory", "lots"], "--kv-cache-memory: 'lots' is not a size"),
    (["core", "--kv-cache-memory", "100B", "--secret-file", "/dev/null"], "holds no block"),
    (["core", "--kv-blocks", "0", "--secret-file", "/dev/null"], "--kv-blocks must be at least 1"),
    (["pack", "/nonexistent", "/tmp/x", "--threads", "0"], "--threads must be at least 1"),
    (["pack", "/nonexistent", "/tmp/x", "--level", "99"], "--level must be a zstd level"),
    (["pack", str(MODEL_DIR), "/dev/null/out"], "packing into /dev/null/out failed"),
])
def test_user_errors_are_one_line_and_non_zero(args, needle):
    r = run(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_every_command_has_help():
    from edgecore.deploy.cli import build_parser
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in commands:
        r = run(name, "--help")
        assert r.returncode == 0 and "usage: edgecore " + name in r.stdout
    assert run("batch", "submit", "--help").returncode == 0


def test_an_unavailable_gpu_is_a_one_line_error():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    r = run("generate", "--prompt", "x", "--device", "cuda")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "edgecore: error: device 'cuda' is not available: this torch build or machine has no CUDA GPU "
        "(use --device cpu)"]
