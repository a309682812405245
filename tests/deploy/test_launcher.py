"""`edgecore up`'s command lines, without starting processes: an edge with `compile = true` in the topology
runs `edgecore edge --compile` (accepted by edgecore's own parser) and the launcher waits longer for it."""

import io

from edgecore.deploy import launcher as launcher_mod
from edgecore.deploy.cli import build_parser
from edgecore.deploy.launcher import COMPILE_WAIT, Launcher, Proc
from edgecore.deploy.topology import load_topology
from tests.deploy.conftest import ROOT


def command_lines(tmp_path, monkeypatch, text: str, tls: bool = False, ready: dict | None = None
                  ) -> tuple[dict, list[float]]:
    (tmp_path / "topology.toml").write_text(text)
    topo = load_topology(tmp_path / "topology.toml")
    spawned, waits = {}, []

    def spawn(self, label, args, ready_url, netns=None):
        spawned[label] = args
        if ready is not None:
            ready[label] = ready_url
        return Proc(label, None, ready_url)
    monkeypatch.setattr(Launcher, "_spawn", spawn)
    monkeypatch.setattr(Launcher, "_wait_ready", lambda self, procs, extra=0.0: waits.append(extra))
    launcher = Launcher(topo, out=io.StringIO(), tls=tls)
    launcher.start()
    if tls:
        spawned["ca"] = launcher          # (its temporary folder, with the certificates, lives as long as it)
    return spawned, waits


def test_compile_reaches_the_edge_command(tmp_path, monkeypatch):
    example = (ROOT / "deploy" / "topology.toml").read_text().replace(
        'path = "../models/pydoc-llama"', f'path = "{ROOT / "models" / "pydoc-llama"}"')
    spawned, waits = command_lines(tmp_path, monkeypatch, example)
    assert not any("--compile" in args for args in spawned.values()) and waits == [0.0, 0.0]

    assert "compile = false" in example
    spawned, waits = command_lines(tmp_path, monkeypatch, example.replace("compile = false", "compile = true", 1))
    west, south = spawned["edge-west/edge-west"], spawned["edge-south/edge-south"]
    assert build_parser().parse_args(west).compile and not build_parser().parse_args(south).compile
    assert waits == [0.0, COMPILE_WAIT] and launcher_mod.COMPILE_WAIT >= 120


def test_nodes_sharing_a_port_on_one_host_are_refused_before_any_starts(tmp_path, monkeypatch):
    import pytest

    from edgecore.shared.errors import EdgecoreError
    text = ('[[regions.a.cores]]\nname = "c"\nport = 9100\nhttp_port = 9101\n'
            '[[regions.b.edges]]\nname = "e"\nport = 9101\n')
    with pytest.raises(EdgecoreError, match="port 9101 is used by both c and e"):
        command_lines(tmp_path, monkeypatch, text)


def test_up_with_tls_gives_every_node_a_certificate_from_one_local_ca(tmp_path, monkeypatch):
    import ssl

    example = (ROOT / "deploy" / "topology.toml").read_text().replace(
        'path = "../models/pydoc-llama"', f'path = "{ROOT / "models" / "pydoc-llama"}"')
    ready: dict[str, str] = {}
    spawned, _ = command_lines(tmp_path, monkeypatch, example, tls=True, ready=ready)
    launcher = spawned.pop("ca")
    ca = launcher.ca.ca_file
    assert spawned and all(url.startswith("https://127.0.0.1:") for url in ready.values())
    for label, args in spawned.items():
        ns = build_parser().parse_args(args)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(ns.tls_cert, ns.tls_key)             # the key matches its certificate
        client = ssl.create_default_context(cafile=ca)           # and a client trusting the CA accepts it
        a, b = ssl.MemoryBIO(), ssl.MemoryBIO()
        server_side = ctx.wrap_bio(a, b, server_side=True)
        client_side = client.wrap_bio(b, a, server_hostname="127.0.0.1")
        for _ in range(10):
            for side in (client_side, server_side):
                try:
                    side.do_handshake()
                except ssl.SSLWantReadError:
                    pass
        assert client_side.version() is not None, label
