"""Rendered Kubernetes manifests validate offline (strict) and their cross-references hold, for the
bundled example topology and a three-region one (GPU cores, a model on a volume, batch clients;
fixtures in conftest.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from edgecore.deploy.k8s import render
from edgecore.deploy.k8s_check import check
from edgecore.deploy.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
yaml = pytest.importorskip("yaml")

def test_kustomize_layout(rendered):
    out, files, docs = rendered
    assert (out / "base" / "kustomization.yaml").is_file()
    for region in ("dc-east", "edge-west", "edge-south"):
        k = yaml.safe_load((out / "overlays" / region / "kustomization.yaml").read_text())
        assert "../../base" in k["resources"]
        for res in k["resources"][1:]:
            assert (out / "overlays" / region / res).is_file()
        m = yaml.safe_load((out / "overlays" / f"{region}-monitoring" / "kustomization.yaml").read_text())
        assert m["resources"][0] == f"../{region}"


def test_manifests_validate_strictly(rendered, three):
    """kubernetes-validate's own command line (--strict) over the built-in kinds; `check` over everything."""
    for out, files in ((rendered[0], rendered[1]), (three[1], three[2])):
        builtin = [str(f) for f in files if f.suffix == ".yaml" and f.name != "kustomization.yaml"
                   and f.name != "monitoring.yaml"]
        r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", *builtin],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "ERROR" not in r.stdout, r.stdout + r.stderr
        assert check(out) == []


def test_check_catches_what_is_wrong(tmp_path, rendered):
    import shutil
    out = tmp_path / "out"
    shutil.copytree(rendered[0], out)
    sts = out / "overlays" / "dc-east" / "core-core-east.yaml"
    sts.write_text(sts.read_text().replace("  serviceName:", "  serviceNme:"))
    mon = out / "overlays" / "edge-west-monitoring" / "monitoring.yaml"
    mon.write_text(mon.read_text().replace('threshold: "4"', "threshold: 4").replace("matchNames:", "matchName:"))
    edge = out / "overlays" / "edge-west" / "edge-edge-west.yaml"
    edge.write_text(edge.read_text().replace('"core-east:7100"', '"core-gone:7100"')
                    .replace('- key: "api-keys"', '- key: "api-key"'))
    k = out / "overlays" / "edge-south" / "kustomization.yaml"
    k.write_text(k.read_text().replace("edge-edge-south.yaml", "edge-gone.yaml"))
    problems = "\n".join(check(out))
    assert "StatefulSet/core-east" in problems
    assert "ScaledObject/edge-west: spec.triggers.0.metadata.threshold: 4 is not of type 'string'" in problems
    assert "ServiceMonitor/edgecore-edge-west: spec.namespaceSelector" in problems
    assert "overlays/edge-south/kustomization.yaml: resources: edge-gone.yaml does not exist" in problems
    assert "overlays/edge-west: Deployment/edge-west: Secret edgecore-secrets has no key api-key" in problems
    assert "overlays/edge-west: Deployment/edge-west: --core-dns core-gone:7100 names no headless Service" in problems
    assert check(rendered[0]) == []


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
            for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health"),
                                ("startupProbe", "/health")):
                assert container[probe]["httpGet"]["path"] == path
                assert container[probe]["httpGet"]["port"] in port_names
            annotations = w["spec"]["template"]["metadata"]["annotations"]
            assert int(annotations["prometheus.io/port"]) == port_names["http"]
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
    for _, so in docs["ScaledObject"]:
        assert so["spec"]["scaleTargetRef"]["name"] in [d["metadata"]["name"] for _, d in docs["Deployment"]]
    for _, pdb in docs["PodDisruptionBudget"]:
        assert sum(pdb["spec"]["selector"]["matchLabels"].items() <= labels_of(d).items()
                   for kind in ("StatefulSet", "Deployment") for _, d in docs[kind]) == 1
    # The probe paths exist on the servers.
    class FakeCore:
        config = type("C", (), {"api_keys": []})()
        http_extensions = []
    paths = {r.resource.canonical for r in core_app(FakeCore()).router.routes()}
    assert {"/health", "/ready", "/metrics"} <= paths
    from edgecore.edge.http import EdgeHTTP
    edge_paths = {r.resource.canonical for r in EdgeHTTP(type("E", (), {"tokenizer": None})(), "m")
                  .build_app().router.routes()}
    assert {"/health", "/ready", "/metrics", "/v1/chat/completions"} <= edge_paths


def test_render_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgecore", "deploy", "render", "--topology",
                        str(ROOT / "deploy" / "topology.toml"), "--out", str(tmp_path / "out"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wrote 17 files" in r.stdout and "validates" in r.stdout, r.stdout + r.stderr


def test_parallel_core_gets_its_layout_and_parses(tmp_path):
    """A TP×PP core in the topology runs with --tp/--pp (and --gather-kv: its Service has one KV port);
    every rendered command line is accepted by edgecore's own parser."""
    from edgecore.deploy.cli import build_parser
    text = (ROOT / "deploy" / "topology.toml").read_text().replace("tp = 1 ", "tp = 2 ", 1)
    assert "tp = 2 " in text
    (tmp_path / "topology.toml").write_text(text)
    files = render(load_topology(tmp_path / "topology.toml"), tmp_path / "out")
    cores = [d for f in files if f.suffix == ".yaml" for d in yaml.safe_load_all(f.read_text())
             if d["kind"] == "StatefulSet"]
    args = cores[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args(args)
    assert (parsed.tp, parsed.pp, parsed.gather_kv) == (2, 1, True)
    for f in files:
        if f.suffix == ".yaml":
            for doc in yaml.safe_load_all(f.read_text()):
                if doc["kind"] in ("StatefulSet", "Deployment"):
                    build_parser().parse_args(doc["spec"]["template"]["spec"]["containers"][0]["args"])
