"""Each node setting is written once (edge/settings.py, core/settings.py): every field is a flag of `edgecore
edge` / `edgecore core` exactly as argparse shows it, every node flag is a field, and the one renderer
(`shared/settings.to_argv`) gives argv that parses back to the same settings — for the edge's engine process,
`edgecore up` and the Kubernetes manifests alike."""

import dataclasses
import io
import typing

import pytest

from edgecore.core.settings import CoreSettings
from edgecore.deploy import node_settings
from edgecore.deploy.cli import build_parser
from edgecore.deploy.k8s_workloads import core_manifests, edge_manifests
from edgecore.deploy.launcher import Launcher, Proc
from edgecore.deploy.topology import load_topology
from edgecore.edge.settings import EdgeSettings
from edgecore.shared.node import settings as machinery
from edgecore.shared.node.settings import flag_names, from_args, specs, to_argv
from tests.conftest import MODEL_DIR

NODES = {"edge": EdgeSettings, "core": CoreSettings}
PLUMBING = {"edge": {"-h", "--help", "--engine-fd"}, "core": {"-h", "--help"}}   # not node settings


def subparser(command: str):
    return build_parser()._subparsers._group_actions[0].choices[command]


def parse(argv: list[str]):
    """`edgecore ARGV` parsed by the real parser, as the settings of its node."""
    return from_args(NODES[argv[0]], build_parser().parse_args(argv))


def changed(cls: type):
    """A settings object with every field set to a value that is not its default."""
    values = {}
    for s in specs(cls):
        if s.kind is bool:
            value = True
        elif s.choices:
            value = next(c for c in s.choices if c != s.default)
        elif s.kind is str:
            value = f"x-{s.name}"
        elif s.kind is int:
            value = 7 if s.default is None else s.default + 7
        else:
            value = -2.5 if s.default is None else s.default * 3 + 0.25    # a leading '-' too
        values[s.name] = (value, f"y-{s.name}") if s.repeated else value
    return cls(**values)


@pytest.mark.parametrize("command", NODES)
def test_every_field_is_a_flag_and_every_node_flag_a_field(command):
    cls, parser = NODES[command], subparser(command)
    actions = {o: a for a in parser._actions for o in a.option_strings}
    fields = flag_names(cls)
    aliases = {alias for s in specs(cls) for alias in s.meta.aliases}
    assert set(actions) - PLUMBING[command] - aliases == set(fields)
    for s in specs(cls):                     # the flag is what the field says: name, default, type, choices, help
        action = actions[s.flag]
        assert action.dest == s.name and action.help == s.meta.help and action.metavar == s.meta.metavar
        assert action.default == ([] if s.repeated and s.default == () else s.default)
        assert action.choices == (list(s.choices) if s.choices else None)
        assert action.type is (None if s.kind in (str, bool) else s.kind)
        assert action.nargs == (0 if s.kind is bool else None)


def test_settings_both_nodes_take_are_the_same_setting():
    edge, core = ({s.name: s for s in specs(cls)} for cls in (EdgeSettings, CoreSettings))
    for name in ("model", "dtype", "device", "kv_cache_memory", "kv_blocks", "max_connections", "header_timeout",
                 "body_timeout", "keepalive_timeout"):
        assert edge[name] == core[name], name
    hints = typing.get_type_hints(EdgeSettings), typing.get_type_hints(CoreSettings)
    assert all(hints[0][name] == hints[1][name] for name in set(edge) & set(core))


@pytest.mark.parametrize("command", NODES)
def test_defaults_render_to_nothing_and_parse_back(command):
    cls = NODES[command]
    assert to_argv(cls()) == []
    assert parse([command]) == cls()


@pytest.mark.parametrize("command", NODES)
def test_every_option_switched_renders_argv_that_parses_back(command):
    settings = changed(NODES[command])
    assert all(getattr(settings, f.name) != f.default for f in dataclasses.fields(settings))
    argv = to_argv(settings)
    assert parse([command, *argv]) == settings
    assert {a.split("=")[0] for a in argv if a.startswith("--")} == set(flag_names(NODES[command]))


def test_values_render_exactly():
    settings = EdgeSettings(core=("a:1", "b:2"), layer0_budget_macs=1e-05, kv_quality_budget=-0.1, adaptive=True,
                            max_concurrent=3)
    assert to_argv(settings) == ["--core", "a:1", "--core", "b:2", "--adaptive", "--kv-quality-budget=-0.1",
                                 "--layer0-budget-macs", "1e-05", "--max-concurrent", "3"]
    assert parse(["edge", *to_argv(settings)]) == settings
    with pytest.raises(ValueError, match="--codec"):
        to_argv(EdgeSettings(codec=()))          # an empty list of codecs has no flags: not the default (None)


def test_a_renamed_flag_still_parses_under_its_old_name():
    assert parse(["edge", "--first-layer-macs", "0"]) == EdgeSettings(layer0_budget_macs=0.0)
    assert to_argv(EdgeSettings(layer0_budget_macs=0.0)) == ["--layer0-budget-macs", "0.0"]


def test_the_engine_process_gets_the_frontends_settings():
    from edgecore.edge.cli import _node_client
    settings = changed(EdgeSettings)
    settings = dataclasses.replace(settings, core=(), core_dns=(), peer=(), peer_listen=None, secret_file=None,
                                   credential=None, authority=None,
                                   revocations=None)          # (files checked before the engine process starts)
    client = _node_client(settings, str(MODEL_DIR))
    argv = [*client.argv, "--model", client.model_dir, "--engine-fd", "3"]      # as NodeProcessClient.start runs it
    assert parse(argv) == dataclasses.replace(settings, model=str(MODEL_DIR))


TOPOLOGY = f"""
[model]
path = "{MODEL_DIR}"
name = "served"
[secrets]
api_keys_file = "/keys"
[[regions.east.cores]]
name = "core-east"
device = "cuda"
tp = 2
pp = 2
port = 7200
http_port = 7201
[[regions.east.edges]]
name = "edge-east"
port = 8100
codecs = ["fp8", "int8"]
transfer_timeout = 4.5
compile = true
[[regions.west.edges]]
name = "edge-west"
"""


@pytest.fixture
def rendered(tmp_path, monkeypatch):
    """Every argv the launcher and the manifests produce, beside every argv the one renderer returned."""
    (tmp_path / "topology.toml").write_text(TOPOLOGY)
    calls = []

    def recording(settings):
        calls.append(settings)
        return to_argv(settings)
    monkeypatch.setattr(node_settings, "to_argv", recording)
    return load_topology(tmp_path / "topology.toml"), calls


def test_launcher_argv_comes_from_the_renderer(rendered, monkeypatch):
    topo, calls = rendered
    spawned = {}

    def spawn(self, label, args, ready_url, netns=None):
        spawned[label.split("/")[1]] = args
        return Proc(label, None, ready_url)
    monkeypatch.setattr(Launcher, "_spawn", spawn)
    monkeypatch.setattr(Launcher, "_wait_ready", lambda self, procs, extra=0.0: None)
    Launcher(topo, out=io.StringIO()).start()
    assert [parse(argv) for argv in spawned.values()] == calls
    core, east, west = (parse(spawned[name]) for name in ("core-east", "edge-east", "edge-west"))
    assert (core.name, core.device, core.tp, core.pp, core.gather_kv, core.listen, core.api_key_file) == \
        ("core-east", "cuda", 2, 2, False, "127.0.0.1:7200", "/keys")
    assert (east.codec, east.transfer_timeout, east.compile, east.core, east.served_model_name, east.model) == \
        (("fp8", "int8"), 4.5, True, ("127.0.0.1:7200",), "served", str(MODEL_DIR))
    assert (west.codec, west.transfer_timeout, west.compile, west.core, west.secret_file) == \
        (("lossless",), 30.0, False, (), None)


def test_manifest_argv_comes_from_the_renderer(rendered):
    topo, calls = rendered

    def args(doc):      # a parallel core's LeaderWorkerSet: the leader runs the core
        template = doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"] if doc["kind"] == "LeaderWorkerSet" \
            else doc["spec"]["template"]
        return template["spec"]["containers"][0]["args"]
    argvs = [args(core_manifests(topo, topo.cores[0])[1]), *(args(edge_manifests(topo, e)[0]) for e in topo.edges)]
    assert [parse(argv) for argv in argvs] == calls
    core, east, west = (parse(argv) for argv in argvs)
    assert (core.name, core.device, core.tp, core.pp, core.gather_kv, core.listen, core.data_dir) == \
        ("core-east", "cuda", 2, 2, True, "0.0.0.0:7200", "/data")
    assert (core.external_workers, core.rendezvous) == (True, "0.0.0.0:29500")
    assert (east.codec, east.transfer_timeout, east.compile, east.core_dns, east.model_from) == \
        (("fp8", "int8"), 4.5, True, ("core-east:7200",), "http://core-east:7201")
    assert (west.codec, west.compile, west.core_dns, west.model_from) == (("lossless",), False, (), None)


def test_a_setting_the_machinery_cannot_render_is_refused_when_declared():
    @dataclasses.dataclass
    class Bad:
        on: bool = machinery.setting(True)
    with pytest.raises(TypeError, match="--on: a switch"):
        specs(Bad)
