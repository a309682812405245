"""Dependencies point one way: protocol imports neither torch nor shared; shared imports no node code."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_protocol_is_torch_free_and_standalone():
    assert not imports("protocol") & {"torch", "shared", "core", "edge", "deploy"}


def test_shared_never_imports_nodes():
    assert not imports("shared") & {"core", "edge", "deploy"}


def test_no_pickle_anywhere():
    for pkg in ("shared", "protocol", "core", "edge", "deploy"):
        assert not imports(pkg) & {"pickle", "cloudpickle", "dill"}
