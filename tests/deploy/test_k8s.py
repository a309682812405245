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
            assert container["imagePullPolicy"] == "IfNotPresent"     # a loaded :latest image starts (kind)
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
    fake_edge = type("E", (), {"tokenizer": None, "vocab_size": 0, "max_model_len": 0})()
    edge_paths = {r.resource.canonical for r in EdgeHTTP(fake_edge, "m").build_app().router.routes()}
    assert {"/health", "/ready", "/metrics", "/v1/chat/completions"} <= edge_paths


def test_render_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgecore", "deploy", "render", "--topology",
                        str(ROOT / "deploy" / "topology.toml"), "--out", str(tmp_path / "out"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wrote 20 files" in r.stdout and "validates" in r.stdout, r.stdout + r.stderr


def test_parallel_core_gets_its_layout_and_parses(tmp_path):
    """A TP×PP core in the topology is a LeaderWorkerSet: the leader runs the core with --tp/--pp,
    --external-workers and its rendezvous port (and --gather-kv: its Service has one KV port, and selects the
    leaders only), each worker pod one `core-worker` rank that joins the leader's address; the group's pods
    reach each other and nothing else does; an edge with `compile = true` runs with --compile; every rendered
    command line is accepted by edgecore's own parser and the manifests check."""
    from edgecore.deploy.cli import build_parser
    from edgecore.deploy.netpol import Cluster
    text = (ROOT / "deploy" / "topology.toml").read_text().replace("tp = 1 ", "tp = 2 ", 1)
    text = text.replace("compile = false", "compile = true", 1)             # edge-west: --compile
    assert "tp = 2 " in text and "compile = true" in text
    (tmp_path / "topology.toml").write_text(text)
    files = render(load_topology(tmp_path / "topology.toml"), tmp_path / "out")
    docs = [d for f in files if f.suffix == ".yaml" for d in yaml.safe_load_all(f.read_text())]
    assert not [d for d in docs if d["kind"] == "StatefulSet"]               # the only core is parallel
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 0, "maxSurge": 1}
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    parsed = build_parser().parse_args(leader["args"])
    assert (parsed.tp, parsed.pp, parsed.gather_kv, parsed.external_workers) == (2, 1, True, True)
    assert parsed.rendezvous == "0.0.0.0:29500"
    worker = group["workerTemplate"]["spec"]["containers"][0]
    assert "readinessProbe" not in worker and worker["image"] == leader["image"]
    args = [a.replace("$(LWS_WORKER_INDEX)", "1").replace("$(LWS_LEADER_ADDRESS)", "core-east-0.core-east")
            for a in worker["args"]]
    parsed = build_parser().parse_args(args)
    assert (parsed.rank, parsed.tp, parsed.pp, parsed.master) == (1, 2, 1, "core-east-0.core-east:29500")
    assert lws["metadata"]["name"] == "core-east-ranks"     # not the Service's name: LWS makes its own
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "core-east")
    assert "topologySpreadConstraints" not in group["workerTemplate"]["spec"]
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "core-east")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= group["workerTemplate"]["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= group["leaderTemplate"]["metadata"]["labels"].items()
    assert not service["spec"]["selector"].items() <= group["workerTemplate"]["metadata"]["labels"].items()
    cluster = Cluster([("edgecore", d) for d in docs])
    leader_pod, worker_pod = cluster.pod("core-east-ranks"), cluster.pod("core-east-ranks-worker")
    assert cluster.allowed(worker_pod, leader_pod, 29500) and cluster.allowed(leader_pod, worker_pod, 40123)
    assert not cluster.allowed(cluster.pod("edge-west"), worker_pod, 40123)
    compiles = {}
    for doc in docs:
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            parsed = build_parser().parse_args(container["args"])
            assert parsed.compile == ("env" in container)    # its compile cache on the pod's volume
            compiles[doc["metadata"]["name"]] = parsed.compile
    assert compiles == {"edge-west": True, "edge-south": False}
    assert check(tmp_path / "out") == []                                    # strict schemas, references


def test_leader_worker_set_templates_are_checked_strictly(tmp_path):
    """A misspelt field inside a LeaderWorkerSet's pod template fails the check as one in a Deployment does."""
    text = (ROOT / "deploy" / "topology.toml").read_text().replace("tp = 1 ", "tp = 2 ", 1)
    (tmp_path / "topology.toml").write_text(text)
    files = render(load_topology(tmp_path / "topology.toml"), tmp_path / "out")
    path = next(f for f in files if "LeaderWorkerSet" in f.read_text())
    path.write_text(path.read_text().replace("terminationGracePeriodSeconds", "terminationGraceSeconds", 1))
    problems = check(tmp_path / "out")
    assert any("LeaderWorkerSet" in p and "leaderTemplate" in p and "terminationGraceSeconds" in p
               for p in problems), problems


def test_any_valid_topology_renders_manifests_that_check(tmp_path):
    """Random valid topologies (regions, cores with parallel layouts and GPUs, edges, links, batch
    clients, both autoscaling modes, HTTPS on or off) render to output that `check` passes and whose policies hold."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from edgecore.deploy.netpol import Cluster, Pod
    names = st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True)
    core = st.fixed_dictionaries({"device": st.sampled_from(["cpu", "cuda"]), "tp": st.integers(1, 2),
                                  "pp": st.integers(1, 2), "replicas": st.integers(1, 3),
                                  "port": st.integers(7000, 7050), "http_port": st.integers(7051, 7100)})
    edge = st.fixed_dictionaries({"replicas": st.integers(1, 3), "port": st.integers(8000, 8100),
                                  "codecs": st.lists(st.sampled_from(["raw", "lossless", "int8"]), min_size=1,
                                                     max_size=2, unique=True)})
    region = st.tuples(st.lists(core, max_size=2), st.lists(edge, max_size=2))

    @settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(names, region, min_size=1, max_size=3), st.sampled_from(["keda", "hpa"]), st.data())
    def check_one(regions, mode, data):
        lines, n = [], 0
        for rname, (cores, edges) in regions.items():
            for kind, specs in (("cores", cores), ("edges", edges)):
                for spec in specs:
                    n += 1
                    lines.append(f"[[regions.r{rname}.{kind}]]\nname = \"n{n}\"")
                    lines += [f"{k} = {json.dumps(v)}" for k, v in spec.items()]
        if n == 0:
            return
        rnames = [f"r{r}" for r, (cores, edges) in regions.items() if cores or edges]
        for a, b in zip(rnames, rnames[1:]):
            lines.append(f'[[links]]\nfrom = "{a}"\nto = "{b}"\ndelay_ms = {data.draw(st.integers(0, 50))}')
        lines.append(f'[kubernetes]\ntls = {json.dumps(data.draw(st.booleans()))}')     # HTTPS or not
        lines.append(f'[kubernetes.autoscaling]\nmode = "{mode}"')
        lines.append('[[kubernetes.batch_clients]]\nname = "etl"\npod_labels = { app = "etl" }')
        (tmp_path / "t.toml").write_text("\n".join(lines) + "\n")
        topo = load_topology(tmp_path / "t.toml")
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        files = render(topo, out)
        problems = check(out)
        assert problems == [], problems
        docs = [(topo.kube.namespace, d) for f in files if f.suffix == ".yaml" and "monitoring" not in str(f)
                and f.name != "kustomization.yaml" for d in yaml.safe_load_all(f.read_text())]
        net = Cluster(docs)
        stranger = Pod("x", "default", {})
        for c in topo.cores:
            name = c.name if c.name.startswith("core") else f"core-{c.name}"
            target = net.pod(name if c.tp * c.pp == 1 else f"{name}-ranks")     # a parallel core's leader
            assert not net.allowed(stranger, target, c.http_port) and not net.allowed(stranger, target, c.port)
            assert net.allowed(Pod("etl", topo.kube.namespace, {"app": "etl"}), target, c.http_port)
            for e in topo.edges:
                source = net.pod(f"edge-{e.name}")
                assert net.allowed(source, target, c.port)
        for e in topo.edges:
            assert net.allowed(stranger, net.pod(f"edge-{e.name}"), e.port)
    import json
    check_one()


def test_cached_strict_schemas_agree_with_kubernetes_validate(rendered):
    """`check_document` builds each strict validator once; it must answer as the library's own call."""
    import copy

    import kubernetes_validate

    from edgecore.deploy.k8s_check import KUBERNETES_VERSION, check_document
    _, files, docs = rendered
    for kind, items in docs.items():
        if kind in ("ServiceMonitor", "ScaledObject", "Kustomization"):
            continue
        doc = items[0][1]
        bad = copy.deepcopy(doc)
        bad.get("spec", bad["metadata"])["bogus"] = 1
        for candidate in (doc, bad):
            try:
                kubernetes_validate.validate(candidate, KUBERNETES_VERSION, strict=True)
                expected = False
            except kubernetes_validate.ValidationError:
                expected = True
            assert bool(check_document(candidate)) == expected, (kind, candidate is bad)
