"""Chaos trials: a real core and edge on loopback, a fault-injecting relay between them, seeded faults.

Life cycle: `ChaosCluster(model, workdir).start()` starts a core process, a `FaultRelay` (on its own
event-loop thread) in front of the core's protocol port, and an edge process connected through the
relay; `reference(prompts)` computes single-node greedy outputs in this process. Each
`run_trial(seed)` draws one fault from the seed (a network fault in the relay, or a process fault:
SIGKILL or SIGSTOP of the core, SIGKILL of the edge's engine process), sends a few concurrent
requests, classifies each answer (identical to single node, clean error, or silent difference), then
waits for the books to balance: blocks in use, leases and open transfers back to zero on both sides.
A killed node is restarted on the same ports before the next trial. `stop()` ends every process and
checks that none is left behind.

A failure replays from its seed: `run_trial(seed)` with the same seed draws the same fault and prompts.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from edgecore.deploy.fault_relay import Fault, FaultRelay, RelayThread
from edgecore.protocol.framing import SEALED

# Frames after the handshake are sealed: their message type is encrypted, so a fault aims at the n-th sealed
# frame of a direction (requests up; KV chunks, PrefillDone and tokens down) or at any frame.
FRAME_TYPES: dict[str, list[int | None]] = {"up": [None, SEALED], "down": [None, SEALED, SEALED]}
PROCESS_FAULTS = ("kill_core", "stop_core", "kill_edge_engine")
RANK_FAULTS = ("kill_rank",)            # a parallel core (core_args with --tp/--pp): SIGKILL one worker rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie (a killed child whose parent died is reaped by init, if ever)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _get(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class TrialResult:
    seed: int
    fault: str
    identical: int = 0
    clean_errors: int = 0
    silent_differences: int = 0
    leaked: dict = field(default_factory=dict)     # what did not return to zero
    detect_s: float | None = None                  # fault → last affected answer


class _Process:
    """A node started as `python -m edgecore ARGS`, ready once it prints its 'ready' line."""

    def __init__(self, args: list[str], log: Path, timeout: float = 120):
        env = {**os.environ, "EDGECORE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.log = open(log, "a")
        self.popen = subprocess.Popen([sys.executable, "-m", "edgecore", *args], stdout=subprocess.PIPE,
                                      stderr=self.log, text=True, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        assert self.popen.stdout is not None       # stdout=PIPE
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if "ready" in line:
                threading.Thread(target=self._drain, daemon=True).start()
                return
            if not line and self.popen.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"edgecore {args[0]} did not start (log: {log})")

    def _drain(self) -> None:
        assert self.popen.stdout is not None
        for _ in iter(self.popen.stdout.readline, ""):
            pass

    def signal_group(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.popen.wait(10)
        self.log.close()

    def stop(self) -> None:
        self.signal_group(signal.SIGTERM)
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


class ChaosCluster:
    def __init__(self, model: str, workdir: Path, transfer_timeout: float = 5.0, max_tokens: int = 12,
                 core_args: tuple[str, ...] = ()):
        self.model, self.workdir, self.max_tokens = model, Path(workdir), max_tokens
        self.core_args = core_args                 # e.g. ("--tp", "2"): a parallel core, whose ranks can be killed
        self.process_faults = PROCESS_FAULTS + (RANK_FAULTS if core_args else ())
        self.transfer_timeout = transfer_timeout
        self.secret = self.workdir / "cluster.secret"
        self.secret.write_text(secrets.token_hex(32))
        self.core_port, self.core_http, self.edge_http = _free_port(), _free_port(), _free_port()
        self.relay = FaultRelay(("127.0.0.1", self.core_port))
        self.relay_thread = RelayThread(self.relay)
        self.core: _Process | None = None
        self.edge: _Process | None = None
        self.refs: dict[tuple[int, ...], str] = {}

    # ---- processes -----------------------------------------------------------------------
    def start(self) -> None:
        self.relay_port = self.relay_thread.start()
        self._start_core()
        self._start_edge()

    def _start_core(self) -> None:
        self.core = _Process(["core", "--model", self.model, "--listen", f"127.0.0.1:{self.core_port}",
                              "--http", f"127.0.0.1:{self.core_http}", "--secret-file", str(self.secret),
                              "--data-dir", str(self.workdir / "core-data"), *self.core_args],
                             self.workdir / "core.log")

    def _start_edge(self) -> None:
        self.edge = _Process(["edge", "--model", self.model, "--listen", f"127.0.0.1:{self.edge_http}",
                              "--core", f"127.0.0.1:{self.relay_port}", "--secret-file", str(self.secret),
                              "--local-prefill-below", "0", "--transfer-timeout", str(self.transfer_timeout)],
                             self.workdir / "edge.log")

    def stop(self) -> list[int]:
        """Stop everything; returns the pids of processes that outlived their node (must be empty)."""
        groups = [p.popen.pid for p in (self.edge, self.core) if p]
        for proc in (self.edge, self.core):
            if proc:
                proc.stop()
        self.relay_thread.stop()
        time.sleep(0.2)
        left = subprocess.run(["pgrep", "-g", ",".join(map(str, groups))], capture_output=True, text=True)
        return [int(p) for p in left.stdout.split() if _alive(int(p))] if groups else []

    # ---- requests ------------------------------------------------------------------------
    def reference(self, prompts: list[list[int]]) -> None:
        from edgecore.shared.engine.engine import LLMEngine
        from edgecore.shared.engine.sampling_params import SamplingParams
        engine = LLMEngine.from_dir(self.model, "fp32", "cpu")
        outs = engine.generate(prompts, SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True))
        self.refs = {tuple(p): o["text"] for p, o in zip(prompts, outs)}

    def _complete(self, prompt: list[int]) -> tuple[str | None, float]:
        body = json.dumps({"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.edge_http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["choices"][0]["text"], time.monotonic()
        except urllib.error.HTTPError as exc:            # a clean error: a JSON error object
            json.loads(exc.read())
            return None, time.monotonic()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None, time.monotonic()

    # ---- trials --------------------------------------------------------------------------
    def run_trial(self, seed: int, requests: int = 3, fault: Fault | None = None,
                  process: str | None = None) -> TrialResult:
        """One trial; `fault` (a network fault) or `process` (one of the process faults) overrides the
        seeded draw (the seed still picks the prompts and the timing)."""
        rng = random.Random(seed)
        prompts = rng.sample(sorted(self.refs), requests)
        if process is not None:
            kind, fault_name = process, process
        elif fault is not None:
            kind, fault_name = "network", f"{fault.kind}:{fault.direction}:{fault.frame_type}:{fault.nth}"
            self.relay.arm(fault)
        elif rng.random() < 0.15:
            kind = rng.choice(self.process_faults)
            fault_name, fault = kind, None
        else:
            fault = Fault.random(rng, FRAME_TYPES)
            kind = "network"
            fault_name = f"{fault.kind}:{fault.direction}:{fault.frame_type}:{fault.nth}"
            self.relay.arm(fault)
        result = TrialResult(seed, fault_name)
        with concurrent.futures.ThreadPoolExecutor(requests + 1) as pool:
            futures = [pool.submit(self._complete, list(p)) for p in prompts]
            fired = self._process_fault(kind, rng) if kind != "network" else None
            answers = [f.result() for f in futures]
        self._classify(result, prompts, answers, fired if fired is not None else self.relay.fired)
        self.relay.arm(None)
        self._recover(kind)
        result.leaked = self._leaks()
        return result

    def _classify(self, result: TrialResult, prompts: list, answers: list[tuple[str | None, float]],
                  fired: float | None) -> None:
        """Count each answer as identical to single node, a clean error, or a silent difference, and
        the time from the fault to the last answer."""
        for prompt, (text, done_at) in zip(prompts, answers):
            if text is None:
                result.clean_errors += 1
            elif text == self.refs[prompt]:
                result.identical += 1
            else:
                result.silent_differences += 1
            if fired is not None:
                result.detect_s = max(result.detect_s or 0.0, done_at - fired)

    def _process_fault(self, kind: str, rng: random.Random) -> float:
        assert self.core is not None and self.edge is not None      # started by start()
        time.sleep(rng.uniform(0.0, 0.3))
        fired = time.monotonic()
        if kind == "kill_core":
            self.core.signal_group(signal.SIGKILL)
        elif kind == "stop_core":
            self.core.signal_group(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 2.0))
            self.core.signal_group(signal.SIGCONT)
        elif kind == "kill_rank":
            ranks = subprocess.run(["pgrep", "-f", "core-worker --rank", "-g", str(self.core.popen.pid)],
                                   capture_output=True, text=True).stdout.split()
            if ranks:
                os.kill(int(rng.choice(ranks)), signal.SIGKILL)
        elif kind == "kill_edge_engine":
            engine = subprocess.run(["pgrep", "-P", str(self.edge.popen.pid)], capture_output=True, text=True)
            for pid in engine.stdout.split():
                os.kill(int(pid), signal.SIGKILL)
        return fired

    def _recover(self, kind: str) -> None:
        assert self.core is not None and self.edge is not None      # started by start()
        if kind in ("kill_core", "kill_rank"):       # a core that lost a rank stays unhealthy: restart it
            self.core.kill()
            self._start_core()
        if self.edge.popen.poll() is not None or kind == "kill_edge_engine":
            self.edge.kill()
            self._start_edge()
        deadline = time.monotonic() + 30          # the edge sees the core healthy again
        while time.monotonic() < deadline:
            cores = _get(f"http://127.0.0.1:{self.edge_http}/stats").get("cores", [])
            if cores and all(c.get("healthy") for c in cores):
                return
            time.sleep(0.1)

    def _leaks(self, timeout: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            edge = _get(f"http://127.0.0.1:{self.edge_http}/stats")
            core = _get(f"http://127.0.0.1:{self.core_http}/stats")
            left = {k: v for k, v in {"edge_blocks": edge.get("blocks_used", 0),
                                      "edge_requests": edge.get("requests", 0),
                                      "core_blocks": core.get("blocks_used", 0), "core_leases": core.get("leases", 0),
                                      "core_transfers": core.get("remote_requests", 0)}.items() if v}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)
