"""Decode steps of the bundled model eager and compiled (`--compile`), side by side in one process.

`bench/decode.py --compiled` builds two engines over the same checkpoint and thread count, one with
`EngineConfig(compile_decode=True)` (shared/models/compiled_decode.py; the compile itself is timed and
reported apart), gives each the same B greedy requests of `prompt_len` tokens, and then, over rounds,
alternates `steps` timed `engine.step()` calls of one with those of the other: whole engine steps
(scheduling, metadata, model, sampling), not the model alone. Reports per batch size the median step
time of each, tokens/s (B / step), the speed-up (eager ÷ compiled step time), and whether both engines
produced the same tokens (they must: greedy, and the compiled step matches the eager one to float32
rounding on this well-separated model).
"""

from __future__ import annotations

import statistics
import time

import torch

from common import ROOT, progress

from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams

MODEL = ROOT / "models" / "pydoc-llama"


def _timed_steps(engine, steps: int, tokens: dict) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t)
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return times


def run(batches: list[int], prompt_len: int, steps: int, rounds: int) -> dict:
    cache = CacheConfig(num_blocks=4096, enable_prefix_caching=False)
    engines = {"eager": LLMEngine.from_dir(MODEL, "fp32", "cpu", cache, EngineConfig(max_num_seqs=256)),
               "compiled": LLMEngine.from_dir(MODEL, "fp32", "cpu", cache,
                                              EngineConfig(max_num_seqs=256, compile_decode=True))}
    start = time.perf_counter()
    progress("compiling the decode step")
    engines["compiled"].compile_decode()
    compile_s = time.perf_counter() - start
    if engines["compiled"].runner.compiled is None:
        raise SystemExit("the decode step did not compile (see the warning above)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        prompts = torch.randint(3, 2048, (b, prompt_len), generator=gen).tolist()
        params = SamplingParams(max_tokens=2 * rounds * steps + 8, temperature=0, ignore_eos=True, detokenize=False)
        tokens: dict = {name: {} for name in engines}
        for name, engine in engines.items():
            for i, p in enumerate(prompts):
                engine.add_request(f"{b}-{i}", p, params)
            _timed_steps(engine, 4, tokens[name])                   # prefill, first decode steps
        times: dict = {name: [] for name in engines}
        for r in range(rounds):
            progress(f"batch {b}: round {r + 1}/{rounds}")
            for name in (engines if r % 2 == 0 else reversed(engines)):
                times[name] += _timed_steps(engines[name], steps, tokens[name])
        for engine in engines.values():
            while engine.has_unfinished():
                engine.step()
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        same = tokens["eager"] == tokens["compiled"]
        rows.append({"batch": b, "eager_step_ms": round(ms["eager"], 3), "compiled_step_ms": round(ms["compiled"], 3),
                     "eager_tok_s": round(b / ms["eager"] * 1e3, 1), "compiled_tok_s": round(b / ms["compiled"] * 1e3, 1),
                     "speedup": round(ms["eager"] / ms["compiled"], 3), "same_tokens": same})
        progress(f"batch {b}: eager {ms['eager']:.3f} ms, compiled {ms['compiled']:.3f} ms a step "
                 f"({ms['eager'] / ms['compiled']:.2f}x), same tokens: {same}")
    return {"rows": rows, "compile_s": round(compile_s, 1), "prompt_tokens": prompt_len, "steps_per_round": steps,
            "rounds": rounds, "threads": torch.get_num_threads()}
