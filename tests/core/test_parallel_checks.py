"""A parallel core's layout check (one line before any rank starts) and its rendezvous binding."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.models.parallel import check_parallel
from tests.conftest import MODEL_DIR

pytestmark = pytest.mark.timeout(120)


def test_check_parallel_names_what_does_not_split():
    config = ModelConfig.from_dir(MODEL_DIR)         # 6 heads, 2 KV heads, MLP 512, 4 layers
    for tp, pp in ((1, 1), (2, 1), (2, 2), (1, 4)):
        check_parallel(config, tp, pp)
    for tp, pp, words in ((3, 1, "2 KV heads"), (4, 1, "6 attention heads"), (6, 1, "intermediate_size 512"),
                          (1, 5, "--pp 5"), (0, 1, "at least 1")):
        with pytest.raises(ValueError, match=words):
            check_parallel(config, tp, pp)


def test_cli_tp3_is_one_line_before_any_rank_starts(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    r = subprocess.run([sys.executable, "-m", "edgecore", "core", "--tp", "3", "--secret-file", str(secret),
                        "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp 3" in lines[0] and "KV heads" in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


PROBE = textwrap.dedent("""
    import os, socket
    from edgecore.shared.models.parallel import init_distributed, rendezvous_socket
    sock = rendezvous_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    init_distributed(0, 1, 1, 4, f"127.0.0.1:{port}", "gloo", listen=sock)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:          # LISTEN, one of this process's sockets
                print(f[1])
    print("store", port)
""")


def test_rendezvous_and_gloo_listen_on_the_configured_host_only():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=90,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    out = r.stdout.split()
    port = int(out[out.index("store") + 1])
    listening = [a for a in out[:out.index("store")]]
    assert listening, r.stdout
    assert f"0100007F:{port:04X}" in listening                   # the store, on 127.0.0.1 and the given port
    assert all(a.startswith("0100007F:") for a in listening), listening   # nothing on every interface
