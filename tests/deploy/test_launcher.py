"""`edgecore up`'s command lines, without starting processes: an edge with `compile = true` in the topology
runs `edgecore edge --compile` (accepted by edgecore's own parser) and the launcher waits longer for it."""

import io

from edgecore.deploy import launcher as launcher_mod
from edgecore.deploy.cli import build_parser
from edgecore.deploy.launcher import COMPILE_WAIT, Launcher, Proc
from edgecore.deploy.topology import load_topology
from tests.deploy.conftest import ROOT


def command_lines(tmp_path, monkeypatch, text: str) -> tuple[dict, list[float]]:
    (tmp_path / "topology.toml").write_text(text)
    topo = load_topology(tmp_path / "topology.toml")
    spawned, waits = {}, []

    def spawn(self, label, args, ready_url, netns=None):
        spawned[label] = args
        return Proc(label, None, ready_url)
    monkeypatch.setattr(Launcher, "_spawn", spawn)
    monkeypatch.setattr(Launcher, "_wait_ready", lambda self, procs, extra=0.0: waits.append(extra))
    Launcher(topo, out=io.StringIO()).start()
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
