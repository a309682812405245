"""`edgecore up`: run a whole topology on this machine as processes.

Life cycle: make the run's credentials → start every core (its own
process group), wait until each answers /ready → start every edge pointed at
its cores, nearest first, wait for /ready → print each edge's URL and an
example request → wait for SIGINT/SIGTERM or a node dying (a signal, SIGHUP
too, while starting stops the start there) → SIGTERM every node (each drains), SIGKILL
what is still alive after the longest drain timeout + 5 s (at least 15 s), remove temporary files. SIGHUP once up is a
rolling restart (`restart_all`): one node at a time, cores first, each sent
SIGTERM (it drains: shared/node/service.py), awaited up to its drain timeout plus
`RESTART_MARGIN` (then killed), started again with the same command line and
awaited on /ready before the next; a stop signal meanwhile stops after the
node being restarted (`kill` and `respawn` are a crash and a supervisor's restart, for bench/soak.py). Nodes that would
share a port on one host are refused first. Each node's output is echoed
with a `[region/node]` prefix. With `--emulate-wan` the nodes run inside
per-region network namespaces (deploy/wan.py) and reach each other through
emulated links.

Credentials: by default the launcher makes a cluster authority for the run in its temporary folder
(`keys/`, laid out as `edgecore keys --dir` expects: authority.key, authority.pub, NODE.cred per node,
issued.txt, an empty revoked.txt) and starts every node with `--credential`, `--authority` and
`--revocations`; `edgecore keys revoke NAME --dir THAT/keys` revokes a node of the live run. The cluster
secret applies too only when the topology names `[secrets] cluster_secret_file`. `shared_secret=True`
(`edgecore up --shared-secret`) is the older mode: one cluster secret (the topology's, or one generated for
the run) and no credentials.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, TextIO

from edgecore.deploy.certs import LocalCA
from edgecore.deploy.node_settings import core_settings, edge_settings, node_argv
from edgecore.deploy.topology import TopologyCore, TopologyEdge, Topology
from edgecore.protocol.credentials import Authority, NodeIdentity
from edgecore.shared.errors import EdgecoreError
from edgecore.shared.node.node_settings import DRAIN_TIMEOUT

if TYPE_CHECKING:
    from edgecore.deploy.wan import WanEmulation

COMPILE_WAIT = 300.0     # seconds more to wait for edges with `compile = true` (a first compile; cached after)
RESTART_MARGIN = 15.0    # seconds past a node's drain timeout before a rolling restart kills it
CREDENTIAL_DAYS = 90.0   # validity of a run's credentials (`edgecore keys issue`'s default)


@dataclass(frozen=True)
class NodeAuth:
    """How the nodes of a run authenticate on the core-edge link: the settings every node gets."""
    secret_file: str | None                  # the cluster secret (shared-secret mode, or named by the topology)
    keys: Path | None = None                 # the run's authority folder (per-node credentials), else None

    def credential(self, name: str) -> str | None:
        return str(self.keys / f"{name}.cred") if self.keys else None

    @property
    def authority(self) -> str | None:
        return str(self.keys / "authority.pub") if self.keys else None

    @property
    def revocations(self) -> str | None:
        return str(self.keys / "revoked.txt") if self.keys else None


@dataclass
class Proc:
    label: str
    popen: subprocess.Popen[str]
    ready_url: str
    cmd: list[str] = field(default_factory=list)      # the full command line, to start it again
    drain_timeout: float = DRAIN_TIMEOUT              # what SIGTERM may take (its `--drain-timeout`)


class Launcher:
    def __init__(self, topology: Topology, emulate_wan: bool = False, data_dir: str | None = None,
                 ready_timeout: float = 180.0, out: TextIO = sys.stdout, tls: bool = False,
                 shared_secret: bool = False, extra_args: dict[str, list[str]] | None = None):
        """`tls`: HTTPS on every node's HTTP port, certificates from a local CA made for this run.
        `shared_secret`: one cluster secret for every node and no per-node credentials. `extra_args`: more
        `edgecore` flags for a node, by its name (benchmarks: flags a topology has no key for)."""
        self.topology = topology
        self.extra_args = extra_args or {}
        self.shared_secret = shared_secret
        self.emulate_wan = emulate_wan
        self.data_dir = Path(data_dir) if data_dir else None
        self.ready_timeout = ready_timeout
        self.out = out
        self.procs: list[Proc] = []
        self.tmp = tempfile.TemporaryDirectory(prefix="edgecore-up-")
        self.wan: WanEmulation | None = None
        self._lock = threading.Lock()
        self.edge_urls: dict[str, str] = {}
        self.ca = LocalCA.create(Path(self.tmp.name) / "ca") if tls else None
        self.scheme = "https" if tls else "http"
        self._client_tls = ssl.create_default_context(cafile=self.ca.ca_file) if self.ca else None

    # ---- output ----------------------------------------------------------------
    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _echo(self, label: str, stream: IO[str]) -> None:
        for line in iter(stream.readline, ""):
            self.say(f"[{label}] {line.rstrip()}")
        stream.close()

    # ---- processes -----------------------------------------------------------------
    def _spawn(self, label: str, args: list[str], ready_url: str, netns: str | None = None) -> Proc:
        cmd = [sys.executable, "-m", "edgecore", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        proc = Proc(label, self._popen(label, cmd), ready_url, cmd)
        self.procs.append(proc)
        return proc

    def _popen(self, label: str, cmd: list[str]) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        threading.Thread(target=self._echo, args=(label, popen.stdout), daemon=True).start()
        return popen

    def _wait_ready(self, procs: list[Proc], extra: float = 0.0) -> None:
        deadline = time.monotonic() + self.ready_timeout + extra
        pending = list(procs)
        while pending:
            for proc in list(pending):
                if proc.popen.poll() is not None:
                    raise EdgecoreError(f"{proc.label} exited with code {proc.popen.returncode} before it was ready")
                try:
                    with urllib.request.urlopen(proc.ready_url, timeout=2, context=self._client_tls) as r:
                        if r.status == 200:
                            pending.remove(proc)
                except OSError:
                    pass
            if pending and time.monotonic() > deadline:
                raise EdgecoreError(f"{', '.join(p.label for p in pending)} not ready after "
                                    f"{self.ready_timeout + extra:.0f} s")
            time.sleep(0.2)

    def _secret_file(self) -> str:
        if self.topology.secret_file:
            return self.topology.secret_file
        path = Path(self.tmp.name) / "cluster.secret"
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
        return str(path)

    def _private(self, path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def _credentials(self) -> Path:
        """An authority for this run and one credential per node (its role and region), in the layout of
        `edgecore keys --dir`; the folder."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        folder = Path(self.tmp.name) / "keys"
        folder.mkdir(mode=0o700)
        authority = Authority.generate()
        self._private(folder / "authority.key",
                      f"authority-key {base64.b64encode(authority.private.private_bytes_raw()).decode()}\n")
        (folder / "authority.pub").write_text(f"authority {base64.b64encode(authority.public).decode()}\n")
        issued = []
        nodes: tuple[TopologyCore | TopologyEdge, ...] = (*self.topology.cores, *self.topology.edges)
        for node in nodes:
            key = Ed25519PrivateKey.generate()
            role = "core" if isinstance(node, TopologyCore) else "edge"
            identity = NodeIdentity(authority.issue(node.name, role, node.region, key, CREDENTIAL_DAYS), key)
            self._private(folder / f"{node.name}.cred", identity.dumps())
            c = identity.credential
            issued.append(f"{c.serial} {c.name} {c.role} {c.region or '-'} until "
                          f"{time.strftime('%Y-%m-%d', time.gmtime(c.not_after))}\n")
        (folder / "issued.txt").write_text("".join(issued))
        (folder / "revoked.txt").write_text("")
        return folder

    def _auth(self) -> NodeAuth:
        """The run's link authentication, and one line saying which it is."""
        if self.shared_secret:
            secret = self._secret_file()
            self.say(f"link authentication: shared-secret mode (one cluster secret for every node, a quick local "
                     f"run; no per-node credentials): {secret}")
            return NodeAuth(secret)
        keys = self._credentials()
        both = f", and the cluster secret {self.topology.secret_file}" if self.topology.secret_file else ""
        self.say(f"link authentication: per-node credentials from an authority made for this run{both}: "
                 f"credentials, authority.pub and revoked.txt in {keys} "
                 f"(`edgecore keys revoke NAME --dir {keys}` revokes a node)")
        return NodeAuth(self.topology.secret_file, keys)

    def _control_key_file(self) -> str:
        path = Path(self.tmp.name) / "control.keys"
        if not path.exists():
            path.write_text(secrets.token_hex(24) + "\n")
            path.chmod(0o600)
        return str(path)

    def _certificate(self, name: str, host: str) -> tuple[str | None, str | None]:
        """(`tls_cert`, `tls_key`) settings for a node at `host` (None without --tls)."""
        if self.ca is None:
            return None, None
        return self.ca.issue(name, sorted({host, "127.0.0.1", "localhost"}), Path(self.tmp.name) / "certs")

    def _check_ports(self) -> None:
        """Nodes share this host (or, with --emulate-wan, their region's namespace): one port each."""
        used: dict[tuple[str, int], str] = {}
        nodes: tuple[TopologyCore | TopologyEdge, ...] = (*self.topology.cores, *self.topology.edges)
        for node in nodes:
            ports = (node.port, node.http_port) if isinstance(node, TopologyCore) else (node.port, node.peer_port)
            for port in ports:
                if port is None:
                    continue
                key = (node.region if self.emulate_wan else "", port)
                if key in used:
                    raise EdgecoreError(f"port {port} is used by both {used[key]} and {node.name}, which would "
                                        "run on one host: give them different ports")
                used[key] = node.name

    def start(self) -> None:
        self._check_ports()
        topo = self.topology
        auth = self._auth()
        addr = {}
        if self.emulate_wan:
            from edgecore.deploy.wan import WanEmulation
            self.wan = WanEmulation(topo, Path(self.tmp.name))
            self.wan.setup()
        for core in topo.cores:
            host = self.wan.host(core.region) if self.wan else "127.0.0.1"
            data = (self.data_dir or Path(self.tmp.name)) / core.name
            # Under WAN emulation a core listens on every address of its namespace, so that
            # edges reach it over the link interfaces.
            bind = "0.0.0.0" if self.wan else host
            settings = replace(core_settings(core), model=topo.model, listen=f"{bind}:{core.port}",
                               http=f"{bind}:{core.http_port}", secret_file=auth.secret_file,
                               credential=auth.credential(core.name), authority=auth.authority,
                               revocations=auth.revocations, data_dir=str(data),
                               # the emulated link relays one port per core: rank 0 sends all KV
                               gather_kv=bool(self.wan) and core.tp * core.pp > 1)
            if topo.api_keys_file or self.wan:   # a control port beyond loopback needs an API key
                settings = replace(settings, api_key_file=topo.api_keys_file or self._control_key_file())
            cert, key = self._certificate(core.name, host)
            settings = replace(settings, tls_cert=cert, tls_key=key)
            self._spawn(f"{core.region}/{core.name}", node_argv(settings) + self.extra_args.get(core.name, []),
                        f"{self.scheme}://{host}:{core.http_port}/ready",
                        self.wan.netns(core.region) if self.wan else None).drain_timeout = settings.drain_timeout
            addr[core.name] = (host, core.port)
        self._wait_ready(list(self.procs))
        edges = []
        for edge in topo.edges:
            host = self.wan.host(edge.region) if self.wan else "127.0.0.1"
            cores = []
            for core in topo.cores_for(edge.region):
                target = self.wan.core_address(edge.region, core) if self.wan else addr[core.name]
                cores.append(f"{target[0]}:{target[1]}")
            peers = [self.wan.peer_address(edge.region, p) if self.wan else ("127.0.0.1", p.peer_port)
                     for p in topo.peers_for(edge)]
            serve = f"{'0.0.0.0' if self.wan else host}:{edge.peer_port}" if edge.peer_port is not None else None
            edge_args = replace(edge_settings(topo, edge), model=topo.model, listen=f"{host}:{edge.port}",
                                core=tuple(cores), peer=tuple(f"{h}:{p}" for h, p in peers), peer_listen=serve,
                                secret_file=auth.secret_file if cores or peers or serve else None,
                                credential=auth.credential(edge.name), authority=auth.authority,
                                revocations=auth.revocations, api_key_file=topo.api_keys_file)
            cert, key = self._certificate(edge.name, host)
            edge_args = replace(edge_args, tls_cert=cert, tls_key=key)
            edges.append(self._spawn(f"{edge.region}/{edge.name}",
                                     node_argv(edge_args) + self.extra_args.get(edge.name, []),
                                     f"{self.scheme}://{host}:{edge.port}/ready",
                                     self.wan.netns(edge.region) if self.wan else None))
            edges[-1].drain_timeout = edge_args.drain_timeout
            self.edge_urls[edge.name] = f"{self.scheme}://{host}:{edge.port}/v1"
        # A first --compile takes a minute or more per edge on a small machine, several at once longer.
        self._wait_ready(edges, COMPILE_WAIT if any(e.compile for e in topo.edges) else 0.0)
        self.say("edgecore is up:")
        for name, url in self.edge_urls.items():
            self.say(f"  {name}: {url}")
        if self.edge_urls:
            first = next(iter(self.edge_urls.values()))
            cacert = f"--cacert {self.ca.ca_file} " if self.ca else ""
            self.say(f"try:\n  curl {cacert}{first}/chat/completions -H 'Content-Type: application/json' "
                     f"-d '{{\"model\": \"{topo.model_name}\", \"messages\": [{{\"role\": \"user\", "
                     f"\"content\": \"What does the for statement do?\"}}], \"max_tokens\": 40}}'")
        self.say(f"Ctrl-C stops everything; `kill -HUP {os.getpid()}` restarts the nodes one at a time (each drained).")

    def restart_all(self, stop: threading.Event | None = None) -> None:
        """Rolling restart: each node in start order (cores, then edges) drained (SIGTERM), started again with
        the same command line and awaited on /ready before the next. `stop` set meanwhile ends it after the
        node in hand. A node that does not come back raises EdgecoreError."""
        self.say(f"rolling restart of {len(self.procs)} node(s), one at a time")
        for proc in self.procs:
            if stop is not None and stop.is_set():
                self.say("rolling restart interrupted")
                return
            self.restart(proc)
        self.say("rolling restart done")

    def restart(self, proc: Proc) -> None:
        """Drain one node (SIGTERM to its group, at most its drain timeout plus a margin, then SIGKILL), start it
        again and wait until it is ready."""
        started = time.monotonic()
        self.say(f"restarting {proc.label}: draining (at most {proc.drain_timeout:g} s)")
        code = self._terminate(proc, proc.drain_timeout + RESTART_MARGIN)
        self.say(f"{proc.label} exited with code {code} after {time.monotonic() - started:.1f} s; starting it again")
        self.respawn(proc, started)

    def kill(self, proc: Proc) -> None:
        """SIGKILL a node's process group (a crash, no drain) and reap it; `respawn` starts it again."""
        with_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(10)
        self.say(f"{proc.label} killed")

    def respawn(self, proc: Proc, since: float | None = None) -> None:
        """Start a node that has exited again, with the same command line, and wait until it is ready (as a
        supervisor would). `since`: when its restart began, for the log line."""
        started = time.monotonic() if since is None else since
        proc.popen = self._popen(proc.label, proc.cmd)
        self._wait_ready([proc])
        self.say(f"{proc.label} is ready again ({time.monotonic() - started:.1f} s)")

    def _terminate(self, proc: Proc, grace: float) -> int | None:
        """SIGTERM the node's process group, wait up to `grace` s, then SIGKILL what is left; its exit code."""
        with_group(proc, signal.SIGTERM)
        try:
            return proc.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.say(f"{proc.label} did not stop within {grace:g} s: killing it")
        with_group(proc, signal.SIGKILL)
        try:
            return proc.popen.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, stop: threading.Event, restart: threading.Event | None = None) -> int:
        """Until `stop` (a signal) or a node exits; `restart` set (SIGHUP) runs a rolling restart."""
        while not stop.is_set():
            if restart is not None and restart.is_set():
                restart.clear()
                try:
                    self.restart_all(stop)
                except EdgecoreError as exc:
                    self.say(f"rolling restart failed: {exc}; stopping")
                    return 1
                continue
            for proc in self.procs:
                if proc.popen.poll() is not None:
                    self.say(f"{proc.label} exited with code {proc.popen.returncode}; stopping")
                    return 1
            stop.wait(0.5)
        return 0

    def stop(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        # nodes drain on SIGTERM: what they have in flight may take up to their drain timeout
        deadline = time.monotonic() + max([15.0] + [p.drain_timeout + 5 for p in self.procs])
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:   # whatever is left of the group, children included
                os.killpg(proc.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self.wan is not None:
            self.wan.teardown()
        self.tmp.cleanup()

    def run(self) -> int:
        """Start, wait, stop. SIGINT or SIGTERM stop every node whenever they come: while waiting they end the
        wait; while starting they interrupt it (as Ctrl-C does), so no node outlives the launcher. SIGHUP does
        the same while starting; once everything is up it asks for a rolling restart (`restart_all`)."""
        stop, waiting, restart = threading.Event(), threading.Event(), threading.Event()

        def on_signal(sig: int, _: object) -> None:
            if sig == signal.SIGHUP and waiting.is_set():
                restart.set()
                return
            stop.set()
            if not waiting.is_set():
                raise KeyboardInterrupt
        handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self.start()
            waiting.set()
            return self.wait(stop, restart)
        finally:
            self.stop()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def with_group(proc: Proc, sig: int) -> None:
    """Send `sig` to a node's process group (the node and its helpers, e.g. an edge's engine process)."""
    try:
        os.killpg(proc.popen.pid, sig)
    except ProcessLookupError:
        pass
