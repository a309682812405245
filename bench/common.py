"""Shared benchmark plumbing: progress on stderr, one JSON line on stdout, a result file."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")     # as the `edgecore` command (deploy/cli.py), before numpy

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:          # the process benches start nodes with the tests' helpers (tests/e2e/procs.py)
    sys.path.append(str(ROOT))


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def engine_tokens_per_s(prompts, max_tokens: int, max_num_seqs: int, num_blocks: int = 8192) -> float:
    """The engine offline on `prompts` (greedy, ignore_eos): generated tokens per second, after a warm-up."""
    import time

    from edgecore.shared.models.config import CacheConfig, EngineConfig
    from edgecore.shared.engine.engine import LLMEngine
    from edgecore.shared.engine.sampling_params import SamplingParams
    engine = LLMEngine.from_dir(ROOT / "models" / "pydoc-llama", cache_config=CacheConfig(num_blocks=num_blocks),
                                engine_config=EngineConfig(max_num_seqs=max_num_seqs))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], params)
    t = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(len(r["token_ids"]) for r in out) / (time.perf_counter() - t)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a note) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    return plt


def emit(name: str, metric: str, value, **extra) -> dict:
    record = {"bench": name, "metric": metric, "value": value, **extra}
    line = json.dumps(record)
    print(line, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
