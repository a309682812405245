"""The manifests' drain and rolling-update objects: grace periods from each node's drain timeout, an edge's
preStop pause, rolling strategies that keep capacity (edges surge before they stop; cores roll one at a time,
the next after the last is Ready a while), zone spreading, a PodDisruptionBudget per core and edge, and the
drain timeout passed to the node; all under kubernetes-validate --strict (and `check`)."""

import subprocess
import sys

import pytest

from edgecore.deploy.k8s import render
from edgecore.deploy.k8s_check import check
from edgecore.deploy.k8s_workloads import GRACE_MARGIN, MIN_READY_SECONDS, PRESTOP_SECONDS, ZONE_KEY
from edgecore.deploy.topology import load_topology
from tests.deploy.conftest import load_docs

pytestmark = pytest.mark.timeout(180)

TOPOLOGY = """
[[regions.east.cores]]
name = "core-a"
replicas = 2
drain_timeout = 45

[[regions.east.cores]]
name = "core-b"
port = 7200
http_port = 7201

[[regions.east.edges]]
name = "edge-a"
replicas = 2
drain_timeout = 120.5

[[regions.west.edges]]
name = "edge-b"
drain_timeout = 0
"""


@pytest.fixture(scope="module")
def drained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain")
    (tmp / "topology.toml").write_text(TOPOLOGY)
    files = render(load_topology(tmp / "topology.toml"), tmp / "out")
    return tmp / "out", files, load_docs(files)


def by_name(docs, kind):
    return {doc["metadata"]["name"]: doc for _, doc in docs.get(kind, [])}


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


def test_grace_periods_follow_each_nodes_drain_timeout(drained):
    _, _, docs = drained
    sts, deps = by_name(docs, "StatefulSet"), by_name(docs, "Deployment")
    expected = {("StatefulSet", "core-a"): (45, None, "45.0"), ("StatefulSet", "core-b"): (30, None, None),
                ("Deployment", "edge-a"): (121, PRESTOP_SECONDS, "120.5"), ("Deployment", "edge-b"): (0, PRESTOP_SECONDS, "0.0")}
    for (kind, name), (drain, prestop, arg) in expected.items():
        pod = (sts if kind == "StatefulSet" else deps)[name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["terminationGracePeriodSeconds"] == (prestop or 0) + drain + GRACE_MARGIN
        if prestop:       # an edge keeps serving while it leaves the Service's endpoints, then drains
            assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": prestop}}}
        else:             # a core's edges hear its drain over the protocol: nothing to wait for
            assert "lifecycle" not in container
        assert flag(container["args"], "--drain-timeout") == arg     # the default (30) is not repeated


def test_rolling_updates_keep_capacity_and_pods_spread_over_zones(drained):
    _, _, docs = drained
    for name, dep in by_name(docs, "Deployment").items():
        assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                           "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}, name
    for sts in by_name(docs, "StatefulSet").values():
        assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
        assert sts["spec"]["minReadySeconds"] == MIN_READY_SECONDS
    for kind in ("Deployment", "StatefulSet"):
        for doc in by_name(docs, kind).values():
            [spread] = doc["spec"]["template"]["spec"]["topologySpreadConstraints"]
            assert spread["topologyKey"] == ZONE_KEY and spread["maxSkew"] == 1
            assert spread["whenUnsatisfiable"] == "ScheduleAnyway"           # a one-zone region still schedules
            assert spread["labelSelector"]["matchLabels"] == doc["spec"]["selector"]["matchLabels"]


def test_every_core_and_edge_has_a_disruption_budget(drained):
    _, _, docs = drained
    pdbs = by_name(docs, "PodDisruptionBudget")
    assert set(pdbs) == {"core-a", "core-b", "edge-a", "edge-b"}
    assert pdbs["core-a"]["spec"]["minAvailable"] == 1 and pdbs["edge-a"]["spec"]["minAvailable"] == 1
    assert pdbs["core-b"]["spec"]["maxUnavailable"] == 1     # one replica: evictable, or node drains would hang
    for name, workload in {**by_name(docs, "StatefulSet"), **by_name(docs, "Deployment")}.items():
        assert pdbs[name]["spec"]["selector"] == workload["spec"]["selector"]


def test_the_new_objects_validate_strictly(drained):
    out, files, _ = drained
    builtin = [str(f) for f in files if f.suffix == ".yaml" and f.name not in ("kustomization.yaml",
                                                                                 "monitoring.yaml")]
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", *builtin],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ERROR" not in r.stdout, r.stdout + r.stderr
    assert check(out) == []


def test_a_drain_timeout_out_of_range_is_a_topology_error(tmp_path):
    from edgecore.deploy.topology import TopologyError
    (tmp_path / "t.toml").write_text(TOPOLOGY.replace("drain_timeout = 45", "drain_timeout = -1"))
    with pytest.raises(TopologyError, match="drain_timeout"):
        load_topology(tmp_path / "t.toml")
