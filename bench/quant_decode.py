"""Decode speed and agreement of quantized weights against float32, edgecore only, on the bundled model.

Variants: the float32 checkpoint; `--quantize int8` and `--quantize int4` of it; the same model written as
GGUF Q8_0 and Q4_0 files (with the `gguf` package's quantizer, as llama.cpp's converter writes them; the
tied embedding table in the file's type too, as `llama-quantize` writes it). For each, at each batch size, decode tokens/s: (time of a `--prompt-len` prompt
+ `--tokens` new tokens − time of the same prompt + 1 token) per generated token after the first, greedy,
ids only; the best of `--rounds` rounds, variants interleaved in each round (a machine shared with other
jobs moves all of them alike). Also each variant's weight bytes (`weight_bytes`: packed and quantized
copies included), its top-1 agreement with float32 on the next token of `--prompts` held-out windows, and
the share of those windows whose 16-token greedy continuation is identical to float32's.

One JSON line on stdout; bench/results/quant_decode.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, emit, progress

MODEL = ROOT / "models" / "pydoc-llama"


def write_ggufs(out: Path) -> dict[str, Path]:
    import json

    import torch
    import transformers

    from edgecore.shared.text.gguf_tokenizer import tokenizer_metadata
    from tests.shared.gguf_checkpoints import write_gguf
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    tok = tokenizer_metadata(MODEL / "tokenizer.json")
    tok["chat_template"] = json.loads((MODEL / "tokenizer_config.json").read_text())["chat_template"]
    return {f"gguf-{k}": write_gguf(hf, out / f"pydoc-{k}.gguf", k, tokenizer=tok, kinds={"token_embd.weight": k})
            for k in ("Q8_0", "Q4_0")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per sequence (default 64)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best is kept (default 3)")
    p.add_argument("--prompts", type=int, default=24, help="held-out windows for the agreement (default 24)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    import torch

    from edgecore.shared.models.config import CacheConfig, EngineConfig
    from edgecore.shared.engine.engine import LLMEngine
    from edgecore.shared.engine.sampling_params import SamplingParams
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    tmp = tempfile.TemporaryDirectory()
    paths: dict[str, tuple[Path, str | None]] = {"float32": (MODEL, None), "int8": (MODEL, "int8"),
                                                  "int4": (MODEL, "int4")}
    paths.update({k: (v, None) for k, v in write_ggufs(Path(tmp.name)).items()})
    engines = {}
    for name, (path, quantize) in paths.items():
        engines[name] = LLMEngine.from_dir(path, "fp32", "cpu", CacheConfig(num_blocks=512, enable_prefix_caching=False),
                                           EngineConfig(quantize=quantize))
        progress(f"{name}: {engines[name].weights_bytes / 1e6:.2f} MB of weights")
    tokenizer = engines["float32"].tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode((MODEL / "heldout.txt").read_text(), add_special_tokens=False)
    prompt = ids[:args.prompt_len]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    many = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, detokenize=False)
    best: dict[tuple[str, int], float] = {}
    for r in range(args.rounds):
        for b in batches:
            for name, engine in engines.items():
                prompts = [prompt[i % 7:] + [i] for i in range(b)]      # distinct prompts: no shared cache
                engine.generate(prompts[:1], one)                        # warm
                t = time.perf_counter()
                engine.generate(prompts, one)
                t1 = time.perf_counter() - t
                prompts = [prompt[i % 7:] + [i + 100] for i in range(b)]
                t = time.perf_counter()
                engine.generate(prompts, many)
                tn = time.perf_counter() - t
                tps = b * (args.tokens - 1) / max(tn - t1, 1e-9)
                best[(name, b)] = max(best.get((name, b), 0.0), tps)
        progress(f"round {r + 1}: " + ", ".join(f"{n}@{b} {v:.0f}" for (n, b), v in best.items()))
    windows = [ids[i:i + 48] for i in range(0, 48 * args.prompts, 48)][:args.prompts]
    greedy16 = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
    reference = [o["token_ids"] for o in engines["float32"].generate(windows, greedy16)]
    rows = []
    for name, engine in engines.items():
        out = [o["token_ids"] for o in engine.generate(windows, greedy16)]
        row = {"variant": name, "weight_bytes": engine.weights_bytes,
               "top1_agreement": sum(a[0] == b[0] for a, b in zip(out, reference)) / len(windows),
               "greedy16_identical": sum(a == b for a, b in zip(out, reference)) / len(windows)}
        for b in batches:
            row[f"decode_tok_s_b{b}"] = round(best[(name, b)], 1)
            row[f"vs_float32_b{b}"] = round(best[(name, b)] / best[("float32", b)], 3)
        rows.append(row)
    emit("quant_decode", "decode_tok_s", rows, threads=args.threads, tokens=args.tokens,
         prompt_len=args.prompt_len, rounds=args.rounds, prompts=args.prompts, torch=torch.__version__)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
