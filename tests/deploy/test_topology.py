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
    # names that would collide as Kubernetes objects or overlays, a port used twice by one pod, a final newline
    ('[[regions.a.cores]]\nname = "core-x"\n[[regions.b.cores]]\nname = "x"\n',
     ":4: 'regions.b.cores[0].name' is named 'core-x' in Kubernetes"),
    ('[[regions.r1.edges]]\nname = "e"\n[[regions.r1-monitoring.edges]]\nname = "f"\n',
     "'regions.r1-monitoring' clashes with the monitoring overlay of region 'r1'"),
    ('[[regions.a.cores]]\nname = "c"\nport = 9000\nhttp_port = 9000\n',
     ":4: 'regions.a.cores[0].http_port' is the core's KV port too"),
    ('[[regions.a.cores]]\nname = "c\\n"\n', ":2: 'regions.a.cores[0].name' is not a valid name"),
    # values the API server or tc would refuse later
    ('[[regions.a.cores]]\nname = "c"\nreplicas = 3000000000\n', ":3: 'regions.a.cores[0].replicas' must be int <="),
    ('[model]\nimage = "my image:1"\n[[regions.a.cores]]\nname = "c"\n', ":2: 'model.image' is not an image reference"),
    ('[[regions.a.edges]]\nname = "e"\n[[regions.b.cores]]\nname = "c"\n[[links]]\nfrom = "a"\nto = "b"\n'
     'delay_ms = inf\n', ":8: 'links[0].delay_ms' must be float <="),
])
def test_errors_name_key_and_line(tmp_path, text, needle):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TopologyError) as exc:
        load_topology(path)
    assert needle in str(exc.value) and str(path) in str(exc.value)


@pytest.mark.parametrize("text, needle", [
    # a sub-table of an array-of-tables element: the line of the key inside it
    ('[[regions.east.cores]]\nname = "c"\n[regions.east.cores.resources]\ncpu = "two"\n',
     ":4: 'regions.east.cores[0].resources.cpu' is not a Kubernetes quantity"),
    ('[[regions.east.cores]]\n[[regions.east.cores]]\nname = "d"\nresources = { gpu = -1 }\n',
     ":4: 'regions.east.cores[1].resources.gpu' must be int >= 0, got -1"),
    ('[[regions.east.edges]]\ncodecs = ["lossless", "zip"]\n',
     ":2: 'regions.east.edges[0].codecs[1]' must be 'raw', 'lossless', 'fp8', 'int8' or 'int4', got 'zip'"),
    ('[[regions.east.edges]]\nreplicas = true\n', ":2: 'regions.east.edges[0].replicas' must be int, got True"),
    ('[[regions.east.edges]]\nport = 70000\n', ":2: 'regions.east.edges[0].port' must be int <= 65535"),
    ('[[regions.e.edges]]\n\n[kubernetes]\nnamespace = "x"\nreplica = 2\n',
     ":5: 'kubernetes.replica' is not a known key (expected autoscaling, batch_clients"),
    ('[[regions.e.edges]]\n[kubernetes.autoscaling]\nmode = "cpu"\n',
     ":3: 'kubernetes.autoscaling.mode' must be 'keda' or 'hpa', got 'cpu'"),
    ('[[regions.e.edges]]\n[[kubernetes.batch_clients]]\nname = "etl"\n',
     ":2: 'kubernetes.batch_clients[0].pod_labels' is required"),
    ('[[regions.e.edges]]\n[kubernetes.secret_files]\napi_keys = "../../etc/keys"\n',
     ":3: 'kubernetes.secret_files.api_keys' is not a relative path without '..'"),
    ('[[regions.e.edges]]\n[kubernetes]\ncore_dns = "core.example"\n', ":3: 'kubernetes.core_dns' is not a DNS name template containing {service}: 'core.example'"),
    ('[[regions.e.edges]]\n[kubernetes]\ncore_dns = "{service}.{zone}"\n',
     ":3: 'kubernetes.core_dns' may use only {service} and {namespace}"),
    ('[[regions.e.edges]]\n[[links]]\nfrom = "e"\nto = "e"\nloss_pct = 100\n',
     ":5: 'links[0].loss_pct' must be float < 100.0, got 100"),
    ('[model]\nname = "m"\n', ":1: 'regions' is required"),
    ('[regions.a]\n', ":1: 'regions' defines no nodes"),
    ('regions = {}\n', ":1: 'regions' must have at least 1 entry"),
])
def test_schema_errors_name_key_and_line(tmp_path, text, needle):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TopologyError) as exc:
        load_topology(path)
    assert needle in str(exc.value), str(exc.value)


def test_kubernetes_settings_and_defaults(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[[regions.gpu.cores]]\nname = "big"\ndevice = "cuda"\ntp = 2\npp = 2\n'
                    '[[regions.gpu.cores]]\nname = "small"\ndevice = "cuda"\nresources = { gpu = 1, cpu = "500m" }\n'
                    '[[regions.west.edges]]\nname = "w"\nreplicas = 3\nmax_replicas = 2\n'
                    '[kubernetes]\nnamespace = "llm"\ndata_pvc_size = "1Ti"\n'
                    '[[kubernetes.batch_clients]]\nname = "etl"\nnamespace = "data"\npod_labels = { app = "etl" }\n')
    t = load_topology(path)
    big, small = t.cores
    assert (big.gpus, small.gpus, small.resources.cpu, big.resources.memory) == (4, 1, "500m", "8Gi")
    assert t.edges[0].max_replicas == 3 and t.edges[0].resources.memory == "4Gi"
    assert (t.kube.namespace, t.kube.data_pvc_size, t.kube.models_pvc_size) == ("llm", "1Ti", "20Gi")
    assert t.kube.batch_clients[0].pod_labels == {"app": "etl"} and t.kube.prometheus.namespace == "monitoring"
    assert t.bundled_model      # no [model] path: the model in the package (and the image)


def test_bundled_example_and_default_topology():
    from edgecore.deploy.topology import EXAMPLE, default_topology
    example = load_topology(EXAMPLE)
    assert example.regions == ("dc-east", "edge-west", "edge-south") and example.bundled_model
    d = default_topology("/tmp/some-model")
    assert (d.cores[0].name, d.edges[0].region, d.model_name, d.bundled_model) == ("core", "local", "some-model", False)


def test_toml_lines_follow_tables_arrays_and_dotted_keys():
    from edgecore.deploy.toml_lines import TomlLines
    text = ('a = 1\n[t]\n"quoted key" = 2\nsub.key = 3\ns = """\nx = not a key\n"""\n'
            '[[arr]]\nv = 1\n[[arr]]\n[arr.inner]\nv = 2\n')
    lines = TomlLines(text)
    assert lines.line(("a",)) == 1 and lines.line(("t", "quoted key")) == 3 and lines.line(("t", "sub", "key")) == 4
    assert lines.line(("t", "x")) == 2                      # inside a multi-line string: not a key; its table
    assert lines.line(("arr", 0, "v")) == 9 and lines.line(("arr", 1, "inner", "v")) == 12
    assert lines.line(("arr", 1, "missing")) == 10 and lines.line(("nowhere",)) == 1


VALUES = ["-1", "0", "1", "true", '"x"', "1.5", "[]", "{}", '"Bad Name"', "70000", '"8Gi"', '["int8"]',
          '{ cpu = "x" }', '"cuda"', "1e400"]


def test_any_value_in_the_example_is_loaded_or_named_at_its_line(tmp_path):
    """Put arbitrary values in the example's keys: the loader either accepts the file or raises a
    TopologyError naming a key whose line (when the key is in the file) is the line it reports."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    import re
    lines = (ROOT / "deploy" / "topology.toml").read_text().splitlines()
    keyed = [i for i, line in enumerate(lines) if re.match(r"^[a-z_]+ = ", line)]
    path = tmp_path / "t.toml"

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(keyed), st.sampled_from(VALUES), min_size=1, max_size=3))
    def check(changes):
        text = list(lines)
        for i, value in changes.items():
            text[i] = text[i].split(" = ", 1)[0] + " = " + value
        path.write_text("\n".join(text) + "\n")
        try:
            load_topology(path)
        except TopologyError as exc:
            message = str(exc)
            found = re.match(rf"^{re.escape(str(path))}:(\d+): '([^']+)'", message)
            if found is None:                     # a TOML syntax error: tomllib's own message
                assert "at line" in message, message
                return
            number, key = int(found[1]), re.split(r"[.\[]", found[2])[-1].rstrip("]")
            assert 1 <= number <= len(text)
            if not key.isdigit() and any(line.startswith(f"{key} = ") for line in text):
                assert text[number - 1].lstrip().startswith(key), (message, changes)
    check()


def test_a_file_that_is_not_utf8_or_not_a_file_is_one_error(tmp_path):
    (tmp_path / "latin1.toml").write_bytes(b'[model]\nname = "caf\xe9"\n')
    with pytest.raises(TopologyError, match="cannot be read as UTF-8"):
        load_topology(tmp_path / "latin1.toml")
    with pytest.raises(TopologyError, match="is not a file"):
        load_topology(tmp_path)
