"""The container images' recipes (deploy/docker/). No container engine runs here, so the images are not
built in tests: the Dockerfiles are parsed and checked (multi-stage, wheel only, non-root, HEALTHCHECK
on /health), their install steps must be the README's, and the wheel they install is built from the
build context `.dockerignore` leaves and must carry the bundled model."""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": ROOT / "deploy" / "docker" / "Dockerfile", "cuda": ROOT / "deploy" / "docker" / "Dockerfile.cuda"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for inst in instructions(path):
        if inst[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(inst)
    return result


def pip_commands(run_lines: list[str], args: dict[str, str]) -> list[list[str]]:
    """`python -m pip ...` commands of RUN lines (split at &&), ARGs substituted, /dist paths as dist/."""
    commands = []
    for line in run_lines:
        for part in line.split("&&"):
            for name, value in args.items():
                part = part.replace("${" + name + "}", value).replace("$" + name, value)
            words = shlex.split(part)
            if words[:3] == ["python", "-m", "pip"]:
                commands.append([re.sub(r"^(/tmp)?/dist/?", "dist/", w).rstrip("/") if "dist" in w else w
                                 for w in words])
    return commands


def readme_pip_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install from a wheel", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("python -m pip")]


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfile_shape(flavour):
    build, runtime = stages(DOCKERFILES[flavour])
    assert build[0][1].endswith("AS wheel") and runtime[0][1].endswith("AS runtime")
    # the runtime stage takes nothing from the source tree: only the wheel from the build stage
    copies = [rest for word, rest in runtime if word in ("COPY", "ADD")]
    assert copies == ["--from=wheel /dist/ /tmp/dist/"]
    user = [rest for word, rest in runtime if word == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    health = [rest for word, rest in runtime if word == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in DOCKERFILES[flavour].read_text() and "CMD" in health[0]
    env = " ".join(rest for word, rest in runtime if word == "ENV")
    assert re.search(r"EDGECORE_HEALTH_URL=http://127\.0\.0\.1:(8000|7101)/health", env)
    assert any(word == "VOLUME" and "/models" in rest for word, rest in runtime)
    entry = [rest for word, rest in runtime if word == "ENTRYPOINT"]
    assert entry == ['["edgecore"]']
    # the default command parses with edgecore's own parser
    from edgecore.deploy.cli import build_parser
    import json
    cmd = json.loads(next(rest for word, rest in runtime if word == "CMD"))
    build_parser().parse_args(cmd)


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_install_steps_are_the_readmes(flavour):
    """Same wheel build, same wheel, same extras, same torch index as the README's install section."""
    insts = instructions(DOCKERFILES[flavour])
    args = dict(rest.split("=", 1) for word, rest in insts if word == "ARG" and "=" in rest)
    image = pip_commands([rest for word, rest in insts if word == "RUN"], args)
    readme = readme_pip_commands()
    assert len(image) == 2, image
    wheel, install = image
    assert wheel == ["python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", "dist", "."]
    assert wheel in readme and install in readme, (image, readme)
    torch_index = install[install.index("--extra-index-url") + 1]
    assert torch_index.endswith("/cpu" if flavour == "cpu" else "/cu124")
    assert install[-1] == "dist/edgecore-*.whl"            # the wheel itself, no extras, no source tree


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rules for the patterns we use: a match on the path or any parent excludes it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or (pattern.startswith("**/") and (
                    fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], bare) or fnmatch.fnmatch(prefix, bare))):
                return True
    return False


@pytest.mark.slow
def test_the_images_wheel_builds_from_the_build_context(tmp_path):
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for rel in (".venv/bin/python", "build/__editable__/x.py", "edgecore.egg-info/PKG-INFO", ".git/HEAD",
                "core/__pycache__/http.cpython-311.pyc", "k8s/base/secrets/api-keys", "cluster.secret"):
        assert dockerignored(rel, patterns), rel        # never sent to the engine (size, secrets)
    for rel in ("pyproject.toml", "README.md", "models/pydoc-llama/model.safetensors", "shared/node/secrets.py"):
        assert not dockerignored(rel, patterns), rel
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=30).stdout.split()
    context = tmp_path / "context"
    kept = [rel for rel in tracked if not dockerignored(rel, patterns) and (ROOT / rel).is_file()]
    assert not any(rel.startswith(("tests/", "bench/", ".git/")) for rel in kept)
    for rel in kept:
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(dist), "."], cwd=context, check=True, timeout=300)
    (wheel,) = dist.glob("edgecore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in ("edgecore/models/pydoc-llama/model.safetensors", "edgecore/models/pydoc-llama/tokenizer.json",
                 "edgecore/models/pydoc-llama/config.json", "edgecore/deploy/topology.toml",
                 "edgecore/deploy/k8s.py", "edgecore/__main__.py"):
        assert need in names, need
