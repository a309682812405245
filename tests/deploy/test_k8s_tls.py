"""HTTPS in the rendered manifests (`[kubernetes] tls = true`): every pod mounts its own node's
kubernetes.io/tls Secret (generated in its region's overlay from secrets/NODE.crt and NODE.key, no hash
suffix) and serves its HTTP port with --tls-cert/--tls-key into that mount, probes are HTTPS, edges fetch
the model over HTTPS trusting the CA Secret, the ServiceMonitors verify each node's certificate, and
`render --check` passes. Off (the default), the output is what it was before the setting existed."""

import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from edgecore.deploy.cli import build_parser, main
from edgecore.deploy.k8s import render
from edgecore.deploy.k8s_check import check
from edgecore.deploy.k8s_refs import gather
from edgecore.deploy.k8s_workloads import core_address, tls_names
from edgecore.deploy.topology import TopologyError, load_topology
from tests.deploy.conftest import ROOT, THREE_REGIONS
from tests.deploy.test_k8s_credentials import in_mount, mounted, node_of, overlays, workloads

yaml = pytest.importorskip("yaml")
DOCS = (ROOT / "docs" / "deploy.md").read_text()
EXAMPLE = (ROOT / "deploy" / "topology.toml").read_text()


def with_tls(text, value="true"):
    assert "\ntls = false " in text
    return text.replace("\ntls = false ", f"\ntls = {value} ", 1)


@pytest.fixture(scope="module")
def tls_example(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls-example")
    (tmp / "topology.toml").write_text(with_tls(EXAMPLE).replace('"../models/', f'"{ROOT}/models/'))
    topo = load_topology(tmp / "topology.toml")
    assert topo.kube.tls
    render(topo, tmp / "out")
    return topo, tmp / "out"


@pytest.fixture(scope="module")
def tls_three(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls-three")
    (tmp / "models" / "tiny").mkdir(parents=True)
    (tmp / "models" / "tiny" / "config.json").write_text("{}")
    text = THREE_REGIONS.format(model=tmp / "models" / "tiny").replace("[kubernetes]\n", "[kubernetes]\ntls = true\n")
    (tmp / "topology.toml").write_text(text)
    topo = load_topology(tmp / "topology.toml")
    render(topo, tmp / "out")
    return topo, tmp / "out"


def test_every_pod_serves_https_from_its_own_tls_secret(tls_example, tls_three):
    for topo, out in (tls_example, tls_three):
        nodes = {n.name for n in (*topo.cores, *topo.edges)}
        seen = set()
        for overlay in overlays(out):
            _, objects = gather(overlay, yaml)
            secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
            region_nodes = {n.name for n in (*topo.cores, *topo.edges) if n.region == overlay.name}
            k = yaml.safe_load((overlay / "kustomization.yaml").read_text())
            generated = {g["name"]: g for g in k["secretGenerator"] if g["name"].startswith("edgecore-tls-")}
            assert set(generated) == {f"edgecore-tls-{n}" for n in region_nodes}
            for n in region_nodes:
                g = generated[f"edgecore-tls-{n}"]
                assert g["type"] == "kubernetes.io/tls"
                assert g["files"] == [f"tls.crt=secrets/{n}.crt", f"tls.key=secrets/{n}.key"]
                assert g["options"] == {"disableNameSuffixHash": True}      # renewed in place, no restart
            for w in workloads(objects):
                node = node_of(w)
                seen.add(node)
                mounts = mounted(w)
                assert [s for s, _ in mounts.values() if s.startswith("edgecore-tls-")] == [f"edgecore-tls-{node}"]
                container = w["spec"]["template"]["spec"]["containers"][0]
                args = build_parser().parse_args(container["args"])
                assert in_mount(args.tls_cert, mounts) == (f"edgecore-tls-{node}", "tls.crt")
                assert in_mount(args.tls_key, mounts) == (f"edgecore-tls-{node}", "tls.key")
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert container[probe]["httpGet"]["scheme"] == "HTTPS", (node, probe)
                assert w["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
                for secret, keys in mounts.values():
                    assert set(keys) <= set(secrets[secret]["data"])
                if getattr(args, "model_from", None):      # an edge fetching from a core: HTTPS, verified
                    assert args.model_from.startswith("https://")
                    env = {e["name"]: e["value"] for e in container["env"]}
                    assert in_mount(env["SSL_CERT_FILE"], mounts) == (f"{topo.secret_name}-tls-ca", "ca.crt")
                    host = args.model_from.removeprefix("https://").rsplit(":", 1)[0]
                    core = next(c for c in topo.cores if core_address(topo, c) == host)
                    assert host in tls_names(topo, core)        # the name its certificate must hold
        assert seen == nodes


def test_the_ca_secret_is_in_the_base(tls_example):
    out = tls_example[1]
    k = yaml.safe_load((out / "base" / "kustomization.yaml").read_text())
    ca = {g["name"]: g for g in k["secretGenerator"]}["edgecore-secrets-tls-ca"]
    assert ca["files"] == ["ca.crt=secrets/tls-ca.crt"] and ca["options"] == {"disableNameSuffixHash": True}


def test_render_check_passes_with_tls(tls_example, tls_three, tmp_path, capsys):
    for _, out in (tls_example, tls_three):
        assert check(out) == []
    topology = tmp_path / "topology.toml"
    topology.write_text(with_tls(EXAMPLE).replace('"../models/', f'"{ROOT}/models/'))
    assert main(["deploy", "render", "--topology", str(topology), "--out", str(tmp_path / "k8s"), "--check"]) == 0
    assert "validates" in capsys.readouterr().out


def test_service_monitors_verify_each_nodes_certificate(tls_example, tls_three):
    for topo, out in (tls_example, tls_three):
        for region in topo.regions:
            _, objects = gather(out / "overlays" / f"{region}-monitoring", yaml)
            secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
            monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
            nodes = [n for n in (*topo.cores, *topo.edges) if n.region == region]
            assert len(monitors) == len(nodes)
            for node, monitor in zip(nodes, monitors):
                assert monitor["spec"]["selector"]["matchLabels"]["edgecore.dev/node"] == node.name
                [endpoint] = monitor["spec"]["endpoints"]
                tls = endpoint["tlsConfig"]
                assert endpoint["scheme"] == "https" and tls["insecureSkipVerify"] is False
                assert tls["serverName"] == f"{tls_names(topo, node)[0]}.{topo.kube.namespace}.svc"
                assert tls["serverName"] in tls_names(topo, node)
                assert tls["ca"]["secret"]["key"] in secrets[tls["ca"]["secret"]["name"]]["data"]


def test_check_catches_a_missing_tls_secret_or_a_certificate_outside_it(tls_example, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tls_example[1], out)
    k = out / "overlays" / "dc-east" / "kustomization.yaml"
    k.write_text(k.read_text().replace('"edgecore-tls-core-east"', '"edgecore-tls-other"'))
    edge = out / "overlays" / "edge-west" / "edge-edge-west.yaml"
    edge.write_text(edge.read_text().replace('"/etc/edgecore-tls/tls.key"', '"/etc/edgecore-tls/key.pem"'))
    mon = out / "overlays" / "edge-south-monitoring" / "monitoring.yaml"
    mon.write_text(mon.read_text().replace('key: "ca.crt"', 'key: "ca.pem"'))
    problems = "\n".join(check(out))
    assert "overlays/dc-east: StatefulSet/core-east: Secret edgecore-tls-core-east is not generated" in problems
    assert "Deployment/edge-west: --tls-key /etc/edgecore-tls/key.pem is no key of a mounted Secret" in problems
    assert "ServiceMonitor/edgecore-edge-south: tlsConfig.ca: Secret edgecore-secrets-tls-ca with key ca.pem" \
        in problems


def test_an_edge_without_cores_mounts_no_ca(tmp_path):
    (tmp_path / "topology.toml").write_text('[[regions.far.edges]]\nname = "alone"\n[kubernetes]\ntls = true\n')
    topo = load_topology(tmp_path / "topology.toml")
    render(topo, tmp_path / "out")
    assert check(tmp_path / "out") == []
    [w] = workloads(gather(tmp_path / "out" / "overlays" / "far", yaml)[1])
    container = w["spec"]["template"]["spec"]["containers"][0]
    assert "env" not in container and "/etc/edgecore-tls-ca" not in mounted(w)
    assert build_parser().parse_args(container["args"]).tls_cert == "/etc/edgecore-tls/tls.crt"


def test_tls_is_validated_like_other_keys(tmp_path):
    text = with_tls(EXAMPLE, '"yes"')
    (tmp_path / "t.toml").write_text(text)
    line = 1 + [x.startswith("tls = ") for x in text.splitlines()].index(True)
    with pytest.raises(TopologyError, match=rf"t.toml:{line}: 'kubernetes.tls'"):
        load_topology(tmp_path / "t.toml")


def _files(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_tls_off_renders_what_it_did_before(tmp_path, rendered, three):
    """`tls = false` (the example's) and no `tls` key render the same bytes (but the ConfigMap, which holds
    the topology's text), with nothing of HTTPS in them."""
    example = EXAMPLE.replace('"../models/', f'"{ROOT}/models/').replace("\ntls = false ", "\n")
    three_text = THREE_REGIONS.format(model=three[0].model).replace("[kubernetes]\n", "[kubernetes]\ntls = false\n")
    for text, out in ((example, rendered[0]), (three_text, three[1])):
        assert text.count("tls = false") == (out == three[1])
        (tmp_path / "off.toml").write_text(text)
        explicit = tmp_path / f"explicit-{out.name}"
        render(load_topology(tmp_path / "off.toml"), explicit)
        before, now = _files(out), _files(explicit)
        assert before.keys() == now.keys()
        for name in before:
            if name != "base/configmap.yaml":
                assert before[name] == now[name], name
                assert not any(w in now[name] for w in (b"tls", b"https", b"HTTPS", b"SSL_CERT_FILE")), name


def test_docs_say_how_to_provide_the_certificates():
    for needle in ("## HTTPS", "tls = true", "kubectl -n edgecore create secret tls edgecore-tls-core-east",
                   "overlays/dc-east/secrets/core-east.crt", "base/secrets/tls-ca.crt", "scheme: https",
                   "cert-manager", "insecureSkipVerify: false", "SSL_CERT_FILE"):
        assert needle in DOCS, needle
    assert "tls = false" in EXAMPLE


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_the_documented_certificate_verifies_as_the_manifests_name_it(tmp_path, tls_example):
    """The docs' openssl command (with a CA made here) gives core-east a certificate that a client trusting
    tls-ca.crt accepts under every name the manifests use for it (edges' --model-from, Prometheus)."""
    from edgecore.shared.node.tls import ServerTLS
    topo = tls_example[0]
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=60)
    made = subprocess.run(["openssl", "req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt",
                           "ec_paramgen_curve:P-256", "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=ca"], **run)
    assert made.returncode == 0, made.stderr
    command = DOCS.split("```sh\ncd k8s && ", 1)[1].split("\ncp ca.crt", 1)[0].replace("\\\n", " ")
    (tmp_path / "overlays" / "dc-east" / "secrets").mkdir(parents=True)
    made = subprocess.run(["sh", "-c", command], **run)
    if made.returncode and "-CA" in made.stderr:
        pytest.skip("openssl older than 3.0")
    assert made.returncode == 0, made.stderr
    secrets = tmp_path / "overlays" / "dc-east" / "secrets"
    server = ServerTLS(str(secrets / "core-east.crt"), str(secrets / "core-east.key"))
    client = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    for name in tls_names(topo, topo.cores[0]):
        a, b = socket.socketpair()
        with a, b:
            served = threading.Thread(target=lambda s=a: server.context.wrap_socket(s, server_side=True).close())
            served.start()
            client.wrap_socket(b, server_hostname=name).close()
            served.join(10)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (its built-in kustomize)")
def test_kustomize_builds_the_tls_secrets_under_the_names_the_pods_mount(tmp_path, tls_example):
    from edgecore.deploy.certs import LocalCA
    topo, out = tls_example[0], tmp_path / "k8s"
    shutil.copytree(tls_example[1], out)
    ca = LocalCA.create(tmp_path / "ca")
    for name in ("api-keys", "authority.pub", "revoked.txt"):
        (out / "base" / "secrets" / name).write_text("x\n")
    shutil.copy(ca.ca_file, out / "base" / "secrets" / "tls-ca.crt")
    for node in (*topo.cores, *topo.edges):
        secrets = out / "overlays" / node.region / "secrets"
        (secrets / f"{node.name}.cred").write_text("x\n")
        cert, key = ca.issue(node.name, tls_names(topo, node), tmp_path / "certs")
        shutil.copy(cert, secrets / f"{node.name}.crt")
        shutil.copy(key, secrets / f"{node.name}.key")
    for overlay in overlays(out):
        built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        objects = [d for d in yaml.safe_load_all(built.stdout) if d]
        secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
        assert set(secrets["edgecore-secrets-tls-ca"]["data"]) == {"ca.crt"}
        for w in workloads(objects):
            volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
            secret = secrets[volumes["tls"]["secret"]["secretName"]]
            assert secret["metadata"]["name"] == f"edgecore-tls-{node_of(w)}"
            assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key"}


def test_ssl_cert_file_is_what_the_model_download_trusts(tmp_path):
    """Edges fetch the model with urllib's default context: with SSL_CERT_FILE (as the manifests set it) a
    certificate from that CA verifies; without it, the same server is refused."""
    import http.server
    import os
    import sys

    from edgecore.deploy.certs import LocalCA
    from edgecore.shared.node.tls import ServerTLS
    ca = LocalCA.create(tmp_path / "ca")
    server_tls = ServerTLS(*ca.issue("core", ["localhost"], tmp_path))
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    httpd.socket = server_tls.context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"https://localhost:{httpd.server_port}/none"
    fetch = (f"import urllib.request, urllib.error\ntry:\n urllib.request.urlopen('{url}', timeout=10)\n"
             "except urllib.error.HTTPError as e:\n print('HTTP', e.code)\n")
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
        trusted = subprocess.run([sys.executable, "-c", fetch], env={**env, "SSL_CERT_FILE": ca.ca_file},
                                 capture_output=True, text=True, timeout=60)
        assert trusted.stdout.strip() == "HTTP 404", trusted.stderr
        refused = subprocess.run([sys.executable, "-c", fetch], env=env, capture_output=True, text=True, timeout=60)
        assert "CERTIFICATE_VERIFY_FAILED" in refused.stderr
    finally:
        httpd.shutdown()
