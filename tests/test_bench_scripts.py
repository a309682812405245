"""Every script in bench/ still imports and parses its arguments (benchmarks run by hand, so drift shows here).

Scripts with a command line answer `--help`; the modules other benchmarks import are imported; the GPU check
reaches its "no CUDA device" exit on a machine without one and runs its steps on the CPU with `--dry-run`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
LIBRARIES = {"common.py", "decode_compiled.py", "decode_floor.py", "decode_moe.py", "kv_alloc.py", "kv_klt.py"}


def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=BENCH.parent)


def test_every_script_is_listed_as_a_command_or_a_library():
    assert LIBRARIES <= set(SCRIPTS), sorted(LIBRARIES - set(SCRIPTS))


@pytest.mark.parametrize("name", [s for s in SCRIPTS if s not in LIBRARIES])
def test_command_answers_help(name):
    r = run(sys.executable, f"bench/{name}", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:"), r.stdout[:200]


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_library_imports(name):
    r = run(sys.executable, "-c", f"import sys; sys.path.insert(0, 'bench'); import {name[:-3]}")
    assert r.returncode == 0, r.stderr


def test_gpu_check_without_cuda_exits_with_its_message():
    r = run("bash", "bench/gpu_check.sh", "--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout, r.stderr
    probe = run(sys.executable, "-c", "import torch; print(torch.cuda.is_available())")
    if probe.stdout.strip() == "True":
        pytest.skip("this machine has a CUDA device: the check would run for real")
    r = run("bash", "bench/gpu_check.sh")
    assert r.returncode == 2, r.stderr
    assert json.loads(r.stdout) == {"bench": "gpu_check", "error": "no CUDA device"}


def test_gpu_check_dry_run_measures_on_the_cpu():
    r = run("bash", "bench/gpu_check.sh", "--dry-run")
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout)
    assert line["device"] == "cpu (dry run)" and line["value"] > 0 and line["decode_tokens_per_s"] > 0
    assert line["decode_batch"] == 16
