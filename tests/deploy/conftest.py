"""Rendered manifests shared by the deploy tests: the example topology and a three-region one."""

from pathlib import Path

import pytest

from edgecore.deploy.k8s import render
from edgecore.deploy.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]

THREE_REGIONS = """
[model]
path = "{model}"
name = "tiny"

[[regions.gpu-east.cores]]
name = "core-east"
device = "cuda"
tp = 2
replicas = 2

[[regions.cpu-west.cores]]
name = "core-west"
resources = {{ cpu = "4", memory = "12Gi", memory_limit = "12Gi" }}

[[regions.cpu-west.edges]]
name = "edge-west"
replicas = 2
max_replicas = 6

[[regions.edge-north.edges]]
name = "edge-north"
port = 8080
codecs = ["lossless", "int8"]

[[links]]
from = "edge-north"
to = "gpu-east"
delay_ms = 30

[[links]]
from = "edge-north"
to = "cpu-west"
delay_ms = 10

[kubernetes]
namespace = "llm"
models_pvc_size = "50Gi"
data_pvc_size = "100Gi"
storage_class = "fast"

[kubernetes.prometheus]
namespace = "observability"
pod_labels = {{ app = "prometheus", tier = "monitoring" }}
service_monitor_labels = {{ release = "kube-prometheus" }}

[[kubernetes.batch_clients]]
name = "etl"
namespace = "data"
pod_labels = {{ app = "etl" }}

[[kubernetes.batch_clients]]
name = "evals"
pod_labels = {{ app = "evals" }}
"""


def load_docs(files):
    import yaml

    docs = {}
    for f in files:
        if f.suffix == ".yaml":
            for doc in yaml.safe_load_all(f.read_text()):
                docs.setdefault(doc["kind"], []).append((f, doc))
    return docs


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("k8s")
    files = render(load_topology(ROOT / "deploy" / "topology.toml"), out)
    return out, files, load_docs(files)


@pytest.fixture(scope="session")
def three(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("three")
    model = tmp / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (tmp / "topology.toml").write_text(THREE_REGIONS.format(model=model))
    topo = load_topology(tmp / "topology.toml")
    files = render(topo, tmp / "out")
    return topo, tmp / "out", files, load_docs(files)


