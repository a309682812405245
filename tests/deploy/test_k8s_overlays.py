"""Each overlay, built as kustomize would gather it, is complete: every object a Pod references is in it
or documented as external; the NetworkPolicies admit exactly the traffic docs/deploy.md describes
(checked with deploy/netpol.py); the monitoring overlay scales edges on a metric the edge exports."""

from pathlib import Path

import pytest

from edgecore.deploy.k8s_refs import gather
from edgecore.deploy.netpol import Cluster, Pod, matches
ROOT = Path(__file__).resolve().parents[2]

yaml = pytest.importorskip("yaml")
DOCS = (ROOT / "docs" / "deploy.md").read_text()


def build(directory: Path) -> tuple[str, list[dict]]:
    """What `kubectl apply -k DIRECTORY` applies (generated Secrets with their keys)."""
    return gather(directory, yaml)


def overlays(out: Path) -> list[Path]:
    return sorted(p for p in (out / "overlays").iterdir() if p.is_dir())


def pod_specs(objects):
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o, o["spec"]["template"]["spec"]


def test_every_pod_reference_resolves(rendered, three):
    makefile = (ROOT / "Makefile").read_text()
    for out in (rendered[0], three[1]):
        for overlay in overlays(out):
            _, objects = build(overlay)
            by_kind = {}
            for o in objects:
                by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
            for workload, spec in pod_specs(objects):
                templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
                # the default ServiceAccount exists in every namespace; pods do not mount its token
                assert "serviceAccountName" not in spec and spec["automountServiceAccountToken"] is False
                assert "default ServiceAccount" in DOCS
                assert set(spec["nodeSelector"]) == {"topology.kubernetes.io/region"}
                assert "kubectl label node NODE topology.kubernetes.io/region=" in DOCS
                for template in workload["spec"].get("volumeClaimTemplates", []):
                    assert template["spec"].get("storageClassName", "fast") == "fast" and "StorageClass" in DOCS
                for container in spec["containers"]:
                    image = container["image"]
                    assert image in ("edgecore:latest", "edgecore:latest-cuda")   # what `make image` tags
                    assert f"$(IMAGE):{image.split(':')[1]}" in makefile and image in DOCS
                    assert "env" not in container and "envFrom" not in container
                    for mount in container["volumeMounts"]:
                        assert mount["name"] in {v["name"] for v in spec["volumes"]} | templates
                for volume in spec["volumes"]:
                    if "secret" in volume:
                        secret = by_kind["Secret"][volume["secret"]["secretName"]]
                        assert {i["key"] for i in volume["secret"]["items"]} <= set(secret["data"])
                    elif "persistentVolumeClaim" in volume:
                        claim = by_kind["PersistentVolumeClaim"][volume["persistentVolumeClaim"]["claimName"]]
                        assert volume["persistentVolumeClaim"]["readOnly"] is True
                        assert claim["spec"]["resources"]["requests"]["storage"]
                    else:
                        assert set(volume) == {"name", "emptyDir"}, volume


def test_three_regions_resources_claims_and_gpus(three):
    topo, out, _, docs = three
    sts = {d["metadata"]["name"]: d for _, d in docs["StatefulSet"]}
    assert "core-east" not in sts                              # tp = 2: a LeaderWorkerSet, one rank per pod
    [lws] = [d for _, d in docs["LeaderWorkerSet"]]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert lws["metadata"]["name"] == "core-east-ranks" and group["size"] == 2 and lws["spec"]["replicas"] == 2
    for template in ("leaderTemplate", "workerTemplate"):
        east = group[template]["spec"]["containers"][0]
        assert east["image"] == "edgecore:latest-cuda"
        assert east["resources"]["limits"]["nvidia.com/gpu"] == "1" == east["resources"]["requests"]["nvidia.com/gpu"]
        assert east["args"][east["args"].index("--model") + 1] == "/models/tiny"
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in east["volumeMounts"]
    assert group["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "100Gi"
    # two groups: one at a time is replaced, the other serves
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 1, "maxSurge": 0}
    west = sts["core-west"]["spec"]["template"]["spec"]["containers"][0]
    assert west["resources"] == {"requests": {"cpu": "4", "memory": "12Gi"}, "limits": {"memory": "12Gi"}}
    assert sts["core-west"]["spec"]["volumeClaimTemplates"][0]["spec"] == {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}}, "storageClassName": "fast"}
    claims = {d["metadata"]["name"]: d["spec"] for _, d in docs["PersistentVolumeClaim"]}
    # regions with cores read the model from a claim; edge-north fetches it from a core
    assert set(claims) == {"edgecore-models-gpu-east", "edgecore-models-cpu-west"}
    assert claims["edgecore-models-gpu-east"]["resources"]["requests"]["storage"] == "50Gi"
    north = next(d for _, d in docs["Deployment"] if d["metadata"]["name"] == "edge-north")
    args = north["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--core-dns"] == ["core-west:7100", "core-east:7100"]
    assert args[args.index("--model-from") + 1] == "http://core-west:7101"
    pdbs = {d["metadata"]["name"]: d["spec"] for _, d in docs["PodDisruptionBudget"]}
    assert pdbs["core-east"].get("minAvailable") == 1 and pdbs["edge-north"].get("maxUnavailable") == 1
    namespaces = [d for _, d in docs["Namespace"]]
    assert [n["metadata"]["name"] for n in namespaces] == ["llm"]


def test_network_policies_admit_what_the_docs_say(three):
    topo, out, _, _ = three
    namespace, objects = build(out / "overlays" / "edge-north")
    everything = [(namespace, o) for o in objects]
    for region in ("gpu-east", "cpu-west"):
        everything += [(namespace, o) for o in build(out / "overlays" / region)[1] if o["kind"] != "NetworkPolicy"]
    net = Cluster(everything)
    north, west_edge, east = net.pod("edge-north"), net.pod("edge-west"), net.pod("core-east-ranks")
    west_core = net.pod("core-west")
    prometheus = Pod("prometheus-0", "observability", {"app": "prometheus", "tier": "monitoring"})
    impostor = Pod("prometheus-0", "default", {"app": "prometheus", "tier": "monitoring"})
    etl = Pod("etl", "data", {"app": "etl"})
    evals = Pod("evals", namespace, {"app": "evals"})
    stranger = Pod("curl", "default", {})
    neighbour = Pod("other", namespace, {"app": "other"})
    assert net.allowed(prometheus, north, 8080)            # Prometheus -> edge-north:8080/metrics
    assert net.allowed(prometheus, east, 7101)             # ... and every core's control port
    assert not net.allowed(prometheus, east, 7100)         # but not the KV protocol
    assert not net.allowed(impostor, east, 7101)           # same labels, wrong namespace
    assert net.allowed(north, east, 7100) and net.allowed(north, west_core, 7101)    # edges -> cores
    assert not net.allowed(north, west_edge, 7100)         # an edge cannot reach another edge's other ports
    assert not net.allowed(east, west_core, 7100)          # nor a core another core
    assert net.allowed(east, north, 8080)                  # a core pushes contexts to edges' /v1/contexts
    assert net.allowed(etl, west_core, 7101) and net.allowed(evals, east, 7101)      # named batch clients
    assert not net.allowed(etl, west_core, 7100)
    for pod in (stranger, neighbour):
        assert not net.allowed(pod, east, 7101) and not net.allowed(pod, east, 7100)
        assert net.allowed(pod, north, 8080)               # the OpenAI API is public
        assert not net.allowed(pod, north, 9000)


def test_policy_evaluator_semantics():
    target = Pod("t", "a", {"app": "t"}, {"http": 80})
    friend, foe = Pod("f", "a", {"role": "friend"}), Pod("x", "b", {"role": "friend"})
    assert Cluster([]).allowed(foe, target, 80)            # no policy selects it: open
    policy = {"kind": "NetworkPolicy", "spec": {
        "podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["t"]}]},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}], "ports": [{"port": "http"}]},
                    {"from": [{"namespaceSelector": {"matchLabels": {"zone": "trusted"}}}],
                     "ports": [{"port": 9000, "endPort": 9010}]}]}}
    net = Cluster([("a", policy)], namespaces={"b": {"zone": "trusted"}})
    assert net.allowed(friend, target, 80) and not net.allowed(foe, target, 80)     # podSelector: own namespace
    assert net.allowed(foe, target, 9005) and not net.allowed(foe, target, 9011)
    assert not net.allowed(friend, target, 80, "UDP")
    assert matches({}, {}) and not matches({"matchExpressions": [{"key": "k", "operator": "Exists"}]}, {})


def test_monitoring_overlay_scales_on_the_edge_queue(three):
    from edgecore.core.metrics import CoreMetrics
    from edgecore.edge.metrics import EdgeMetrics
    topo, out, _, _ = three
    edge_metrics = {m.name for m in EdgeMetrics().registry.collect()}
    assert "edgecore:num_requests_waiting" in edge_metrics
    namespace, objects = build(out / "overlays" / "cpu-west-monitoring")
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    scraped = [o for o in objects if o["kind"] == "Service" and matches(monitor["spec"]["selector"],
                                                                         o["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in scraped} == {"core-west", "edge-west"}
    for service in scraped:
        assert monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]
    scaler = next(o for o in objects if o["kind"] == "ScaledObject")
    trigger = scaler["spec"]["triggers"][0]
    assert trigger["metadata"]["query"] == 'sum(edgecore:num_requests_waiting{namespace="llm",service="edge-west"})'
    assert (trigger["metadata"]["threshold"], scaler["spec"]["minReplicaCount"],
            scaler["spec"]["maxReplicaCount"]) == ("4", 2, 6)
    kustomization = yaml.safe_load((out / "overlays" / "cpu-west-monitoring" / "kustomization.yaml").read_text())
    assert kustomization["patches"][0]["patch"].strip().endswith("path: /spec/replicas")
    assert "edgecore:kv_cache_usage_perc" in {m.name for m in CoreMetrics().registry.collect()}


def test_hpa_mode_uses_a_pods_metric(tmp_path):
    from edgecore.deploy.k8s import render
    from edgecore.deploy.k8s_check import check
    from edgecore.deploy.topology import load_topology
    (tmp_path / "t.toml").write_text('[[regions.west.edges]]\nname = "edge-w"\n'
                                     '[kubernetes.autoscaling]\nmode = "hpa"\nqueue_target = 2.5\n')
    render(load_topology(tmp_path / "t.toml"), tmp_path / "out")
    assert check(tmp_path / "out") == []
    docs = list(yaml.safe_load_all((tmp_path / "out" / "overlays" / "west-monitoring" / "monitoring.yaml").read_text()))
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"] == {"metric": {"name": "edgecore_num_requests_waiting"},
                                                 "target": {"type": "AverageValue", "averageValue": "2.5"}}
    assert "edgecore_num_requests_waiting" in DOCS
