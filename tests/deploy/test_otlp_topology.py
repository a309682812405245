"""A topology's `otlp_endpoint` per core and edge: the node runs with `--otlp-endpoint` (locally and in the
manifests, from the one renderer); anything but an http(s) URL is a topology error naming the key."""

import pytest

from edgecore.deploy.node_settings import core_settings, edge_settings, node_argv
from edgecore.deploy.topology import TopologyError, load_topology

TOPOLOGY = """
[[regions.east.cores]]
name = "core-a"
otlp_endpoint = "http://otel-collector.observability:4318"

[[regions.east.edges]]
name = "edge-a"
otlp_endpoint = "https://otel.example.com/v1/traces"

[[regions.east.edges]]
name = "edge-b"
port = 8001
"""


def test_nodes_export_where_their_topology_says(tmp_path):
    (tmp_path / "t.toml").write_text(TOPOLOGY)
    topo = load_topology(tmp_path / "t.toml")
    core = node_argv(core_settings(topo.cores[0]))
    edges = {e.name: node_argv(edge_settings(topo, e)) for e in topo.edges}
    assert core[core.index("--otlp-endpoint") + 1] == "http://otel-collector.observability:4318"
    assert edges["edge-a"][edges["edge-a"].index("--otlp-endpoint") + 1] == "https://otel.example.com/v1/traces"
    assert "--otlp-endpoint" not in edges["edge-b"]                  # off unless asked for


@pytest.mark.parametrize("url", ["otel:4318", "http://", "http://a b:4318", "ftp://otel:4318"])
def test_an_endpoint_that_is_not_an_http_url_is_a_topology_error(tmp_path, url):
    (tmp_path / "t.toml").write_text(TOPOLOGY.replace("http://otel-collector.observability:4318", url))
    with pytest.raises(TopologyError, match="otlp_endpoint"):
        load_topology(tmp_path / "t.toml")
