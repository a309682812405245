#!/usr/bin/env bash
# Prepared check for a machine with a CUDA GPU (CI never has one): prefill and decode tokens/s at
# TP=1 for a ~1B-parameter random Llama in bf16, printed as one JSON line (and bench/results/gpu_check.json).
# Usage: bash bench/gpu_check.sh [--dry-run]   (uses .venv/bin/python if present, else python3)
#   Without a CUDA device it prints {"error": "no CUDA device"} and exits 2, after importing everything it uses.
#   --dry-run: the same steps on the CPU with a tiny config, nothing written (the test suite runs it, so the
#   script cannot drift from the engine's API unnoticed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" - "$@" <<'PYCODE'
import argparse, json, sys, time
sys.path.insert(0, "bench")
import torch
from common import emit
from edgecore.shared.models.config import CacheConfig, EngineConfig, ModelConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.loader import build_model

ap = argparse.ArgumentParser(prog="gpu_check.sh", description="Prefill and decode tokens/s on one CUDA GPU.")
ap.add_argument("--dry-run", action="store_true", help="a tiny config on the CPU; prints the line, writes nothing")
args = ap.parse_args(sys.argv[1:])
if args.dry_run:
    device, dtype = "cpu", torch.float32
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    n_prompts, prompt_len, decode_len, blocks = 4, 64, 8, 256
elif not torch.cuda.is_available():
    print(json.dumps({"bench": "gpu_check", "error": "no CUDA device"}))
    sys.exit(2)
else:
    device, dtype = "cuda", torch.bfloat16
    shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=8)
    n_prompts, prompt_len, decode_len, blocks = 16, 1024, 128, 8192


def sync() -> None:
    if device == "cuda":
        torch.cuda.synchronize()


cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, **shape})
model = build_model(cfg, dtype, device)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
params = sum(p.numel() for p in model.parameters())
engine = LLMEngine(model, cfg, None, CacheConfig(num_blocks=blocks), EngineConfig(max_num_batched_tokens=8192,
                                                                                 max_num_seqs=256))
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(5, shape["vocab_size"] - 5, (prompt_len,), generator=gen).tolist() for _ in range(n_prompts)]
engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0))
sync()
t = time.perf_counter()
engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
sync()
prefill = n_prompts * prompt_len / (time.perf_counter() - t)
batch = [p[:128] for p in prompts] * 4
t = time.perf_counter()
out = engine.generate(batch, SamplingParams(max_tokens=decode_len, temperature=0, ignore_eos=True))
sync()
decode = sum(len(r["token_ids"]) for r in out) / (time.perf_counter() - t)
extra = dict(decode_tokens_per_s=round(decode, 1), decode_batch=len(batch), parameters=params,
             dtype=str(dtype).removeprefix("torch."), tp=1)
if args.dry_run:
    print(json.dumps({"bench": "gpu_check", "metric": "prefill_tokens_per_s", "value": round(prefill, 1),
                      "device": "cpu (dry run)", **extra}))
else:
    emit("gpu_check", "prefill_tokens_per_s", round(prefill, 1), device=torch.cuda.get_device_name(0), **extra)
PYCODE
