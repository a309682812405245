"""Dependencies point one way: protocol imports neither torch nor shared; shared imports no node code.

Every project import goes through the one namespace, `edgecore` (`edgecore.shared.engine`, ...).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "protocol", "core", "edge", "deploy", "models")


def imports(package: str) -> set[str]:
    """Top-level names a package imports; `edgecore.X...` counts as `X`."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                found.add(parts[1] if parts[0] == "edgecore" and len(parts) > 1 else parts[0])
    return found


def bare_imports(package: str) -> set[str]:
    """Project packages imported without the `edgecore.` prefix (would break in a wheel)."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def test_protocol_is_torch_free_and_standalone():
    assert not imports("protocol") & {"torch", "shared", "core", "edge", "deploy"}


def test_shared_never_imports_nodes():
    assert not imports("shared") & {"core", "edge", "deploy"}


def test_every_project_import_is_namespaced():
    for pkg in (*PACKAGES, "tests", "bench"):
        assert not bare_imports(pkg), f"{pkg} imports {bare_imports(pkg)} outside the edgecore namespace"


def test_no_pickle_anywhere():
    for pkg in PACKAGES:
        assert not imports(pkg) & {"pickle", "cloudpickle", "dill"}


def test_files_and_functions_stay_small():
    """Small files named after their nouns: none over 500 lines (a file that grows past it is split by concept, never
    squeezed under it); no function over 60 in the nodes."""
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            assert len(path.read_text().splitlines()) <= 500, f"{path} has over 500 lines"
    for pkg in ("core", "edge"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    assert length <= 60, f"{path}:{node.lineno} {node.name} has {length} lines"
