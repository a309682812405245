"""Topology files: the example validates; errors name the key and the line."""

import pytest

from edgecore.deploy.topology import TopologyError, load_topology

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_example_topology_loads():
    t = load_topology(ROOT / "deploy" / "topology.toml")
    assert t.regions == ("dc-east", "edge-west", "edge-south")
    assert [c.name for c in t.cores_for("edge-south")] == ["core-east"]
    assert t.link("dc-east", "edge-south").delay_ms == 45


@pytest.mark.parametrize("text, needle", [
    ('[[regions.east.cores]]\nname = "c"\ntp = "two"\n', ":3: 'regions.east.cores[0].tp' must be int"),
    ('[[regions.east.cores]]\nname = "c"\ngpus = 2\n', ":3: 'regions.east.cores[0].gpus' is not a known key"),
    ('[[regions.east.edges]]\nname = "e"\n[[links]]\nfrom = "east"\nto = "mars"\n',
     ":5: 'links[0].to' names unknown region 'mars'"),
    ('[[regions.east.cores]]\nname = "c"\ndevice = "tpu"\n', ":3: 'regions.east.cores[0].device' must be 'cpu'"),
    ('[[regions.East.cores]]\nname = "c"\n', "'regions.East' is not a valid name"),
    ('[[regions.a.cores]]\nname = "x"\n[[regions.b.edges]]\nname = "x"\n', ":4: 'regions.b.edges[0].name' repeats"),
    ("[regions\n", "Expected"),
])
def test_errors_name_key_and_line(tmp_path, text, needle):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TopologyError) as exc:
        load_topology(path)
    assert needle in str(exc.value) and str(path) in str(exc.value)
