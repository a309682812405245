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


def started(tmp_path, monkeypatch, text: str, **kwargs) -> tuple[Launcher, dict, str]:
    """A launcher started on `text` with nodes that do not run: (it, label → parsed argv, what it printed)."""
    (tmp_path / "topology.toml").write_text(text)
    spawned = {}

    def spawn(self, label, args, ready_url, netns=None):
        spawned[label] = build_parser().parse_args(args)
        return Proc(label, None, ready_url)
    monkeypatch.setattr(Launcher, "_spawn", spawn)
    monkeypatch.setattr(Launcher, "_wait_ready", lambda self, procs, extra=0.0: None)
    out = io.StringIO()
    launcher = Launcher(load_topology(tmp_path / "topology.toml"), out=out, **kwargs)
    launcher.start()
    return launcher, spawned, out.getvalue()


NODES = ('[[regions.dc.cores]]\nname = "core-dc"\n[[regions.west.edges]]\nname = "edge-west"\n'
         '[[regions.lone.edges]]\nname = "edge-lone"\nport = 8001\n'
         '[[links]]\nfrom = "west"\nto = "dc"\ndelay_ms = 5\n')


def test_up_issues_every_node_its_own_credential(tmp_path, monkeypatch):
    """By default: an authority for the run, one credential per node (its role and region), an empty
    revocation list, no cluster secret; the folder works with `edgecore keys`."""
    from pathlib import Path

    from edgecore.deploy.cli import main
    from edgecore.protocol.credentials import load_node_credentials
    launcher, spawned, said = started(tmp_path, monkeypatch, NODES)
    try:
        roles = {"dc/core-dc": ("core", "dc"), "west/edge-west": ("edge", "west"), "lone/edge-lone": ("edge", "lone")}
        assert set(spawned) == set(roles)
        serials = set()
        for label, ns in spawned.items():
            assert ns.secret_file is None
            identity, trust = load_node_credentials(ns.credential, ns.authority, ns.revocations)
            c = identity.credential
            assert (c.name, (c.role, c.region)) == (label.split("/")[1], roles[label])
            assert Path(ns.revocations).read_text() == "" and trust.revoked == set()
            assert Path(ns.credential).stat().st_mode & 0o077 == 0
            serials.add(c.serial)
        assert len(serials) == 3 and len({ns.authority for ns in spawned.values()}) == 1
        keys = Path(spawned["dc/core-dc"].credential).parent
        assert f"per-node credentials from an authority made for this run: credentials, authority.pub and " \
               f"revoked.txt in {keys}" in said and "cluster secret" not in said
        assert main(["keys", "revoke", "edge-west", "--dir", str(keys)]) == 0     # as the printed line says
        _, trust = load_node_credentials(spawned["dc/core-dc"].credential, spawned["dc/core-dc"].authority,
                                         spawned["dc/core-dc"].revocations)
        west = load_node_credentials(spawned["west/edge-west"].credential, spawned["west/edge-west"].authority,
                                     None)[0]
        assert trust.revoked == {west.credential.serial}
    finally:
        launcher.tmp.cleanup()


def test_up_shared_secret_mode_and_a_named_secret(tmp_path, monkeypatch):
    """--shared-secret: one generated cluster secret, no credentials (an edge without cores needs none).
    A topology naming a cluster secret: credentials and that secret both."""
    from pathlib import Path
    launcher, spawned, said = started(tmp_path, monkeypatch, NODES, shared_secret=True)
    try:
        secret = spawned["dc/core-dc"].secret_file
        assert secret and Path(secret).read_text() and spawned["west/edge-west"].secret_file == secret
        assert spawned["lone/edge-lone"].secret_file is None
        assert all(ns.credential is ns.authority is ns.revocations is None for ns in spawned.values())
        assert "shared-secret mode" in said and secret in said and "per-node" in said
    finally:
        launcher.tmp.cleanup()
    (tmp_path / "cluster.secret").write_text("s" * 32)
    named = f'[secrets]\ncluster_secret_file = "{tmp_path / "cluster.secret"}"\n' + NODES
    launcher, spawned, said = started(tmp_path, monkeypatch, named)
    try:
        assert spawned["dc/core-dc"].secret_file == spawned["west/edge-west"].secret_file == \
            str(tmp_path / "cluster.secret")
        assert all(ns.credential and ns.authority and ns.revocations for ns in spawned.values())
        assert f"and the cluster secret {tmp_path / 'cluster.secret'}" in said
    finally:
        launcher.tmp.cleanup()


def test_up_has_a_shared_secret_switch():
    args = build_parser().parse_args(["up", "--shared-secret"])
    assert args.shared_secret and not build_parser().parse_args(["up"]).shared_secret
    up = build_parser()._subparsers._group_actions[0].choices["up"].format_help()
    assert "shared-secret mode, for a quick local run" in " ".join(up.split())


def test_edges_with_a_peer_port_serve_each_other_cached_kv(tmp_path, monkeypatch):
    """`peer_port`: the edge serves cached KV there (`--peer-listen`); the edges of its own and linked regions pull
    from it (`--peer`), an edge of an unlinked region does not; the ports are checked like the others."""
    import pytest

    from edgecore.shared.errors import EdgecoreError
    text = ('[[regions.dc.cores]]\nname = "core-dc"\n'
            '[[regions.west.edges]]\nname = "edge-west"\npeer_port = 7300\n'
            '[[regions.west.edges]]\nname = "edge-west-2"\nport = 8002\n'
            '[[regions.east.edges]]\nname = "edge-east"\nport = 8001\npeer_port = 7301\n'
            '[[regions.lone.edges]]\nname = "edge-lone"\nport = 8003\n'
            '[[links]]\nfrom = "west"\nto = "dc"\ndelay_ms = 5\n'
            '[[links]]\nfrom = "west"\nto = "east"\ndelay_ms = 20\n')
    launcher, spawned, _ = started(tmp_path, monkeypatch, text)
    try:
        west, west2 = spawned["west/edge-west"], spawned["west/edge-west-2"]
        east, lone = spawned["east/edge-east"], spawned["lone/edge-lone"]
        assert (west.peer_listen, west.peer) == ("127.0.0.1:7300", ["127.0.0.1:7301"])
        assert (west2.peer_listen, west2.peer) == (None, ["127.0.0.1:7300", "127.0.0.1:7301"])   # nearest first
        assert (east.peer_listen, east.peer) == ("127.0.0.1:7301", ["127.0.0.1:7300"])
        assert (lone.peer_listen, lone.peer) == (None, [])
        assert east.credential and lone.credential
    finally:
        launcher.tmp.cleanup()
    with pytest.raises(EdgecoreError, match="port 8003 is used by both edge-east and edge-lone"):
        started(tmp_path, monkeypatch, text.replace("peer_port = 7301", "peer_port = 8003"))
