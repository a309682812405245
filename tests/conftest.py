"""Shared fixtures: the bundled model, one engine per session, the transformers reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")     # as the `edgecore` command (deploy/cli.py), before numpy

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "pydoc-llama"

torch.set_num_threads(2)
# Few-row matmuls switch layout at a fixed row count, not one timed at each start-up: the two layouts round
# differently, and servers started by tests must compute what the in-process engines do, bit for bit.
# Tests of the timing itself unset it.
os.environ.setdefault("EDGECORE_PACKED_FROM_ROWS", "8")
# Likewise small steps run on one thread, not on the count their timing chose (tests/shared/test_step_threads.py).
os.environ.setdefault("EDGECORE_SMALL_STEP_THREADS", "one")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return MODEL_DIR


@pytest.fixture(scope="session")
def golden() -> dict:
    return json.loads((MODEL_DIR / "golden.json").read_text())


@pytest.fixture(scope="session")
def heldout() -> str:
    return (MODEL_DIR / "heldout.txt").read_text()


@pytest.fixture(scope="session")
def tokenizer():
    from edgecore.shared.text.tokenizer import Tokenizer
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="session")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()


def make_engine(model_dir=MODEL_DIR, **kw):
    from edgecore.shared.models.config import CacheConfig, EngineConfig
    from edgecore.shared.engine.engine import LLMEngine
    cache = CacheConfig(block_size=kw.pop("block_size", 16), num_blocks=kw.pop("num_blocks", 1024),
                        enable_prefix_caching=kw.pop("prefix_caching", True), kv_dtype=kw.pop("kv_dtype", None))
    eng = EngineConfig(max_num_batched_tokens=kw.pop("budget", 2048), max_num_seqs=kw.pop("max_seqs", 128),
                       compile_decode=kw.pop("compile_decode", False), speculative=kw.pop("speculative", None))
    return LLMEngine.from_dir(model_dir, kw.pop("dtype", "fp32"), "cpu", cache, eng)


@pytest.fixture
def engine():
    return make_engine()


@pytest.fixture
def one_torch_thread():
    """Tiny matmuls: one thread (other test modules may have raised the count; on a busy 2-core machine
    two threads' barriers make these 10x slower). Modules opt in with `usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


try:   # deterministic property tests: the same examples on every run
    from hypothesis import settings as _hsettings
    _hsettings.register_profile("edgecore", derandomize=True, deadline=None, print_blob=True)
    _hsettings.load_profile("edgecore")
except ImportError:
    pass
