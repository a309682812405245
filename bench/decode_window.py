"""Decode step time of a sliding-window model at long contexts: reading only the window's blocks against
reading the whole block table with the window as a mask (what decode did before), in the same run.

A random-weight Mixtral-shaped model (4 layers, hidden 256, 8 query / 4 KV heads of 64, 4 experts top-2,
`sliding_window` 256, float32). Sequences get their context without a prefill (reserved and activated as
if their KV had arrived from a core: decode time does not depend on the values), then `--steps` greedy
decode steps are timed per variant, the two variants alternating, `--repeats` times; medians per step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import emit, progress

import torch

from edgecore.shared.models.config import CacheConfig, EngineConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.model_runner import ModelRunner, first_visible
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.attention import DecodeWindow

WINDOW = 256
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
             max_position_embeddings=32768 + 256, sliding_window=WINDOW, bos_token_id=0, eos_token_id=1)


def full_masked(runner: ModelRunner, form, table: torch.Tensor, ctx: torch.Tensor) -> DecodeWindow:
    """The baseline: every block of the context is read, the window applied as a mask."""
    length = int(ctx.max())
    pos = torch.arange(length).unsqueeze(0)
    return DecodeWindow(table, length, ((pos < ctx) & (pos >= first_visible(form, ctx - 1)))[:, None, None, :])


def step_times(engine: LLMEngine, context: int, batch: int, steps: int, repeats: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=(steps + 1) * repeats * 2 + 2, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(context)
    for i in range(batch):
        rid = f"s{context}-{i}"
        engine.reserve(rid, torch.randint(2, 4000, (context,), generator=gen).tolist(), params)
        engine.activate(rid, 5)
    engine.step()          # warm-up
    runner, window_view = engine.runner, ModelRunner._decode_window
    times: dict[str, list[float]] = {"window_blocks": [], "full_table_masked": []}
    for _ in range(repeats):
        for name in times:
            runner._decode_window = (lambda *a: window_view(runner, *a)) if name == "window_blocks" else \
                (lambda *a: full_masked(runner, *a))
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append((time.perf_counter() - t) / steps)
    runner._decode_window = lambda *a: window_view(runner, *a)
    for i in range(batch):
        engine.abort(f"s{context}-{i}")
    return {name: statistics.median(v) for name, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    contexts = [int(x) for x in args.contexts.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE)).save_pretrained(tmp)
        blocks = args.batch * (max(contexts) + 16 * (args.steps + 1) * args.repeats * 2 + 64) // 16 + 64
        engine = LLMEngine.from_dir(tmp, "fp32", "cpu", CacheConfig(num_blocks=blocks),
                                    EngineConfig(max_num_seqs=args.batch))
    rows = {}
    for context in contexts:
        t = step_times(engine, context, args.batch, args.steps, args.repeats)
        rows[context] = {name: round(v * 1e3, 3) for name, v in t.items()} | {
            "ratio_window_over_full": round(t["window_blocks"] / t["full_table_masked"], 3)}
        progress(f"context {context}: step ms {rows[context]}")
    longest = rows[max(contexts)]
    emit("decode_window", "step_time_ratio_window_over_full_at_longest", longest["ratio_window_over_full"],
         unit="ms per decode step (batch of sequences)", batch=args.batch, window=WINDOW,
         threads=torch.get_num_threads(), results={str(k): v for k, v in rows.items()}, model=SHAPE)


if __name__ == "__main__":
    main()
