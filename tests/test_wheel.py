"""The wheel is the release: built from this checkout, installed into a fresh virtual environment
outside the repository, it must carry the bundled model and the example topology, add exactly one
top-level name (`edgecore`), and run `edgecore generate` and `edgecore up` from another directory.

The fresh environment takes its third-party dependencies (torch, aiohttp, ...) from the running
interpreter's site-packages through a .pth line, so that the test needs no download; edgecore itself
comes only from the wheel (the running environment's editable install is not visible there).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, timeout=300, cwd=out)
    (whl,) = out.glob("edgecore-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    site = Path(subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, timeout=300)
    # pip --target writes no console script: the wheel's entry point, as an installer would make it.
    script = env_dir / "bin" / "edgecore"
    script.write_text(f"#!{env_dir / 'bin' / 'python'}\nimport sys\nfrom edgecore.deploy.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return env_dir


def test_wheel_adds_one_top_level_name_with_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"edgecore"}
    for need in ("edgecore/__main__.py", "edgecore/py.typed", "edgecore/deploy/topology.toml",
                 "edgecore/models/pydoc-llama/model.safetensors", "edgecore/models/pydoc-llama/tokenizer.json"):
        assert need in names, need
    assert not any(n.startswith(("edgecore/tests/", "edgecore/bench/")) for n in names)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EDGECORE_MODEL")}
    return {**env, "EDGECORE_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(venv: Path, cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the fresh environment's `python` or `edgecore` with ARGS in CWD (outside the repository)."""
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_env())


def test_installed_wheel_imports_only_the_namespace(venv, tmp_path):
    code = textwrap.dedent("""
        import importlib, edgecore, edgecore.shared.engine
        from edgecore.models import bundled_model_dir
        assert (bundled_model_dir() / 'model.safetensors').is_file()
        for name in ('core', 'shared', 'edge', 'protocol', 'deploy'):
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                continue
            raise SystemExit(f'{name} is importable')
        print('ok', list(edgecore.__path__)[0])
    """)
    r = _run(venv, tmp_path, "python", "-c", code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert str(ROOT) not in r.stdout                       # edgecore comes from the wheel, not the checkout
    version = _run(venv, tmp_path, "edgecore", "--version")
    assert version.returncode == 0 and version.stdout.startswith("edgecore "), version.stderr
    helped = _run(venv, tmp_path, "python", "-m", "edgecore", "--help")
    assert helped.returncode == 0 and "generate" in helped.stdout


def test_installed_wheel_generates_with_the_bundled_model(venv, tmp_path):
    r = _run(venv, tmp_path, "edgecore", "generate", "--prompt", "The for statement",
             "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_installed_wheel_runs_up_and_stops(venv, tmp_path):
    ports = [_free_port() for _ in range(3)]
    model = _run(venv, tmp_path, "python", "-c",
                 "from edgecore.models import bundled_model_dir; print(bundled_model_dir())").stdout.strip()
    topo = tmp_path / "topology.toml"
    topo.write_text(f'[model]\npath = "{model}"\n[[regions.dc.cores]]\nname = "core"\nport = {ports[0]}\n'
                    f'http_port = {ports[1]}\n[[regions.dc.edges]]\nname = "edge"\nport = {ports[2]}\n')
    proc = subprocess.Popen([str(venv / "bin" / "edgecore"), "up", "--topology", str(topo)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=_env())
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops everything" in line or not line:
                break
        assert f"http://127.0.0.1:{ports[2]}/v1" in "".join(lines), "".join(lines)
        # Keep reading `up`'s output (its nodes' echoed logs), so that a failure to stop shows the last of it.
        rest = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        rest.start()
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("edgecore up did not stop within 60 s of SIGINT:\n" + "".join(lines[-60:]))
        assert code in (0, 130), "".join(lines[-60:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
