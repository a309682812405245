"""A topology run on this machine for a measurement: `edgecore up` as a child process, its edges' URLs.

Life cycle: `start_fleet(topology, emulate_wan, log)` starts `edgecore up --shared-secret` (in its own session)
and returns once it prints that everything is up, with each edge's name → base URL; its output goes to `log`.
`stop_fleet(proc)` stops it as Ctrl-C does (resuming it first if it was paused), killing the session after a
minute. Used by `edgecore profile --serving` (deploy/serving_probe.py) and bench/plan_validate.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path


def start_fleet(topology: Path, emulate_wan: bool, log: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    cmd = [sys.executable, "-m", "edgecore", "up", "--topology", str(topology), "--shared-secret"]
    cmd += ["--emulate-wan"] if emulate_wan else []
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, text=True, start_new_session=True)
    urls: dict[str, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        out.write(line)
        m = re.match(r"\s+([a-z0-9-]+): (https?://\S+)/v1$", line)
        if m:
            urls[m.group(1)] = m.group(2)
        if line.startswith("Ctrl-C stops everything"):
            threading.Thread(target=lambda: [out.write(x) for x in proc.stdout or ()], daemon=True).start()
            return proc, urls
    raise RuntimeError(f"edgecore up exited ({proc.wait()}); see {log}")


def stop_fleet(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)      # (a launcher paused to let a node die alone)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
