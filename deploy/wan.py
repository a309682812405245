"""WAN emulation for `edgecore up --emulate-wan` (root): namespaces, per-link veths, tbf, nftables, relays.

Life cycle: `setup()` first removes leftovers of an earlier run (namespaces
`ec-*`, interfaces `eca*`/`ecl*`), then builds:
- per region a namespace `ec-REGION` with an access veth to the root namespace
  (10.213.I.1 root side, 10.213.I.2 region side) through which clients and
  readiness checks reach the region's nodes;
- per link a veth pair directly between the two regions' namespaces
  (10.214.L.1 / 10.214.L.2) with `tc tbf` at the link's bandwidth on both ends
  and an nftables rule dropping `loss_pct` of the packets leaving either end;
- per (edge region, linked core) a delay/jitter relay (`edgecore wan-relay`)
  inside the edge's namespace, listening on 127.0.0.1 and forwarding over the
  link (this kernel has no netem, so delay and jitter are added in userspace);
  the same per (edge region, peer edge of a linked region serving cached KV).
`teardown()` stops the relays and deletes the namespaces (and with them every
interface and rule). `cut(a, b)` takes a link down (`up=True` back up); `set_bandwidth(a, b, mbit)`
changes its cap (faults of `bench/soak.py`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from edgecore.deploy.topology import TopologyCore, TopologyEdge, Topology
from edgecore.shared.errors import ConfigError

PREFIX = "ec-"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ConfigError(f"WAN emulation: '{' '.join(cmd)}' failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def cleanup_leftovers() -> None:
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX):
            _run("ip", "netns", "del", name, check=False)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(("eca", "ecl")):
                _run("ip", "link", "del", name, check=False)


class WanEmulation:
    def __init__(self, topology: Topology, workdir: Path):
        self.topo = topology
        self.workdir = workdir
        self.index = {region: i for i, region in enumerate(topology.regions)}
        self.relays: dict[tuple[str, str], int] = {}     # (edge region, core name) → relay port
        self.procs: list[subprocess.Popen] = []

    def netns(self, region: str) -> str:
        return PREFIX + region

    def host(self, region: str) -> str:
        return f"10.213.{self.index[region]}.2"

    def link_ifaces(self, a: str, b: str) -> tuple[str, str, int]:
        for l, link in enumerate(self.topo.links):
            if (link.a, link.b) == (a, b):
                return f"ecl{l}a", f"ecl{l}b", l
            if (link.a, link.b) == (b, a):
                return f"ecl{l}b", f"ecl{l}a", l
        raise KeyError((a, b))

    def core_address(self, edge_region: str, core: TopologyCore) -> tuple[str, int]:
        if core.region == edge_region:
            return "127.0.0.1", core.port
        return "127.0.0.1", self.relays[(edge_region, core.name)]

    def setup(self) -> None:
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise ConfigError("WAN emulation needs the 'ip' and 'tc' commands (iproute2)")
        if any(link.loss_pct for link in self.topo.links) and shutil.which("nft") is None:
            raise ConfigError("WAN emulation of loss needs nftables ('nft'): apt-get install nftables")
        cleanup_leftovers()
        for region, i in self.index.items():
            ns = self.netns(region)
            _run("ip", "netns", "add", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "link", "add", f"eca{i}", "type", "veth", "peer", "name", f"eca{i}n")
            _run("ip", "link", "set", f"eca{i}n", "netns", ns)
            _run("ip", "addr", "add", f"10.213.{i}.1/24", "dev", f"eca{i}")
            _run("ip", "link", "set", f"eca{i}", "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"10.213.{i}.2/24", "dev", f"eca{i}n")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", f"eca{i}n", "up")
        for l, link in enumerate(self.topo.links):
            a_if, b_if = f"ecl{l}a", f"ecl{l}b"
            _run("ip", "link", "add", a_if, "type", "veth", "peer", "name", b_if)
            for iface, region, addr in ((a_if, link.a, f"10.214.{l}.1/24"), (b_if, link.b, f"10.214.{l}.2/24")):
                ns = self.netns(region)
                _run("ip", "link", "set", iface, "netns", ns)
                _run("ip", "netns", "exec", ns, "ip", "addr", "add", addr, "dev", iface)
                _run("ip", "netns", "exec", ns, "ip", "link", "set", iface, "up")
                if link.bandwidth_mbit:
                    self._tbf(ns, iface, link.bandwidth_mbit)
                if link.loss_pct:
                    self._loss(ns, iface, link.loss_pct)
        for edge in self.topo.edges:
            for core in self.topo.cores_for(edge.region):
                if core.region == edge.region or (edge.region, core.name) in self.relays:
                    continue
                route = self.topo.link(edge.region, core.region)
                assert route is not None          # cores_for lists only cores of this or a linked region
                _, _, l = self.link_ifaces(edge.region, core.region)
                core_ip = f"10.214.{l}.1" if self.topo.links[l].a == core.region else f"10.214.{l}.2"
                port = 17000 + 100 * self.index[edge.region] + len(self.relays)
                self._relay(edge.region, port, f"{core_ip}:{core.port}", route.delay_ms, route.jitter_ms)
                self.relays[(edge.region, core.name)] = port
            for peer in self.topo.peers_for(edge):
                if peer.region != edge.region and (edge.region, peer.name) not in self.relays:
                    assert peer.peer_port is not None                 # peers_for lists serving edges only
                    self._relay_to(edge.region, peer.region, peer.name, peer.peer_port)

    def _relay_to(self, region: str, far: str, name: str, target_port: int) -> None:
        """A relay in `region` to node `name` of the linked region `far`, listening on `target_port` there."""
        route = self.topo.link(region, far)
        assert route is not None
        _, _, l = self.link_ifaces(region, far)
        ip = f"10.214.{l}.1" if self.topo.links[l].a == far else f"10.214.{l}.2"
        port = 17000 + 100 * self.index[region] + len(self.relays)
        self._relay(region, port, f"{ip}:{target_port}", route.delay_ms, route.jitter_ms)
        self.relays[(region, name)] = port

    def peer_address(self, edge_region: str, peer: TopologyEdge) -> tuple[str, int]:
        """Where an edge of `edge_region` reaches a peer edge's `peer_port` (its relay, or the region's loopback)."""
        assert peer.peer_port is not None
        if peer.region == edge_region:
            return "127.0.0.1", peer.peer_port
        return "127.0.0.1", self.relays[(edge_region, peer.name)]

    @staticmethod
    def _tbf(ns: str, iface: str, mbit: float) -> None:
        """A token bucket at `mbit` on the interface (replacing one that is there)."""
        burst = max(16384, int(mbit * 1e6 / 8 / 250))   # ~4 ms of traffic
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", iface, "root", "tbf", "rate", f"{mbit}mbit",
             "burst", str(burst), "latency", "100ms")

    def _loss(self, ns: str, iface: str, pct: float) -> None:
        threshold = int(round(pct * 100))    # of 10000
        table = f"ecwan_{iface}"
        _run("ip", "netns", "exec", ns, "nft", "add", "table", "inet", table)
        _run("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", table, "out",
             "{ type filter hook output priority 0 ; }")
        _run("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", table, "out", "oifname", iface,
             "numgen", "random", "mod", "10000", "lt", str(threshold), "drop")

    def _relay(self, region: str, port: int, target: str, delay: float, jitter: float) -> None:
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns(region), sys.executable, "-m", "edgecore",
                                 "wan-relay", "--listen", f"127.0.0.1:{port}", "--target", target, "--delay-ms",
                                 str(delay), "--jitter-ms", str(jitter)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append(proc)
        assert proc.stdout is not None                   # stdout=PIPE
        line = proc.stdout.readline()
        if "relay ready" not in line:
            raise ConfigError(f"WAN relay for {region} did not start: {line.strip()}")

    def cut(self, a: str, b: str, up: bool = False) -> None:
        """Take the link between regions `a` and `b` down (both ends), or back up with `up`."""
        a_if, b_if, _ = self.link_ifaces(a, b)
        state = "up" if up else "down"
        _run("ip", "netns", "exec", self.netns(a), "ip", "link", "set", a_if, state)
        _run("ip", "netns", "exec", self.netns(b), "ip", "link", "set", b_if, state)

    def set_bandwidth(self, a: str, b: str, mbit: float) -> None:
        """Change the link's bandwidth cap, both directions (`tc qdisc replace`)."""
        a_if, b_if, _ = self.link_ifaces(a, b)
        self._tbf(self.netns(a), a_if, mbit)
        self._tbf(self.netns(b), b_if, mbit)

    def teardown(self) -> None:
        import os
        import signal
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        time.sleep(0.1)
        cleanup_leftovers()
