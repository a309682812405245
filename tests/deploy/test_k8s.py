"""Rendered Kubernetes manifests validate offline (strict) and their cross-references hold."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgecore.deploy.k8s import render
from edgecore.deploy.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
yaml = pytest.importorskip("yaml")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("k8s")
    files = render(load_topology(ROOT / "deploy" / "topology.toml"), out)
    docs = {}
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            docs.setdefault(doc["kind"], []).append((f, doc))
    return out, files, docs


def test_kustomize_layout(rendered):
    out, files, docs = rendered
    assert (out / "base" / "kustomization.yaml").is_file()
    for region in ("dc-east", "edge-west", "edge-south"):
        k = yaml.safe_load((out / "overlays" / region / "kustomization.yaml").read_text())
        assert "../../base" in k["resources"]
        for res in k["resources"][1:]:
            assert (out / "overlays" / region / res).is_file()


def test_manifests_validate_strictly(rendered):
    out, files, _ = rendered
    resources = [str(f) for f in files if f.name != "kustomization.yaml"]
    exe = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert exe, "kubernetes-validate is a test dependency"
    r = subprocess.run([exe, "--strict", "--quiet", *resources], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cross_references(rendered):
    _, _, docs = rendered
    from edgecore.core.http import build_app as core_app

    def labels_of(doc):
        return doc["spec"]["template"]["metadata"]["labels"]

    services = {d["metadata"]["name"]: d for _, d in docs["Service"]}
    for kind in ("StatefulSet", "Deployment"):
        for _, w in docs[kind]:
            pod_labels = labels_of(w)
            sel = w["spec"]["selector"]["matchLabels"]
            assert sel.items() <= pod_labels.items()
            container = w["spec"]["template"]["spec"]["containers"][0]
            port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
            for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
                assert container[probe]["httpGet"]["path"] == path
                assert container[probe]["httpGet"]["port"] in port_names
            args = container["args"]
            listen = args[args.index("--listen") + 1]
            assert int(listen.rsplit(":", 1)[1]) in port_names.values()
            if kind == "StatefulSet":
                http = args[args.index("--http") + 1]
                assert port_names["http"] == int(http.rsplit(":", 1)[1])
                assert w["spec"]["serviceName"] in services
                assert services[w["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
                assert w["spec"]["template"]["spec"]["nodeSelector"]["topology.kubernetes.io/region"] == \
                    pod_labels["edgecore.dev/region"]
            else:
                # --core-dns names a headless core Service, on its kv port.
                for i, a in enumerate(args):
                    if a == "--core-dns":
                        name, port = args[i + 1].split(":")
                        assert name in services
                        assert int(port) in [p["port"] for p in services[name]["spec"]["ports"] if p["name"] == "kv"]
    for _, svc in docs["Service"]:
        matches = [w for kind in ("StatefulSet", "Deployment") for _, w in docs[kind]
                   if svc["spec"]["selector"].items() <= labels_of(w).items()]
        assert len(matches) == 1
    for _, hpa in docs["HorizontalPodAutoscaler"]:
        assert hpa["spec"]["scaleTargetRef"]["name"] in [d["metadata"]["name"] for _, d in docs["Deployment"]]
    for _, pdb in docs["PodDisruptionBudget"]:
        assert any(pdb["spec"]["selector"]["matchLabels"].items() <= labels_of(d).items() for _, d in docs["Deployment"])
    # The probe paths exist on the servers.
    class FakeCore:
        config = type("C", (), {"api_keys": []})()
        http_extensions = []
    paths = {r.resource.canonical for r in core_app(FakeCore()).router.routes()}
    assert {"/health", "/ready"} <= paths
    from edgecore.edge.http import EdgeHTTP
    edge_paths = {r.resource.canonical for r in EdgeHTTP(type("E", (), {"tokenizer": None})(), "m")
                  .build_app().router.routes()}
    assert {"/health", "/ready", "/v1/chat/completions"} <= edge_paths
    # Network policies: cores accept only edges, on the cores' ports.
    core_policy = next(d for _, d in docs["NetworkPolicy"] if d["metadata"]["name"] == "edgecore-core-ingress")
    assert core_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "edge"


def test_render_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgecore", "deploy", "render", "--topology",
                        str(ROOT / "deploy" / "topology.toml"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "wrote 9 files" in r.stdout


def test_parallel_core_gets_its_layout_and_parses(tmp_path):
    """A TP×PP core in the topology runs with --tp/--pp (and --gather-kv: its Service has one KV port);
    every rendered command line is accepted by edgecore's own parser."""
    from edgecore.deploy.cli import build_parser
    text = (ROOT / "deploy" / "topology.toml").read_text().replace("tp = 1 ", "tp = 2 ", 1)
    assert "tp = 2 " in text
    (tmp_path / "topology.toml").write_text(text)
    files = render(load_topology(tmp_path / "topology.toml"), tmp_path / "out")
    cores = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d["kind"] == "StatefulSet"]
    args = cores[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args(args)
    assert (parsed.tp, parsed.pp, parsed.gather_kv) == (2, 1, True)
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc["kind"] in ("StatefulSet", "Deployment"):
                build_parser().parse_args(doc["spec"]["template"]["spec"]["containers"][0]["args"])
