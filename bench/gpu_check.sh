#!/usr/bin/env bash
# Prepared check for a machine with a CUDA GPU (CI never runs it): prefill and decode tokens/s at
# TP=1 for a ~1B-parameter random Llama in bf16, printed as one JSON line (and bench/results/gpu_check.json).
# Usage: bash bench/gpu_check.sh   (uses .venv/bin/python if present, else python3; torch with CUDA needed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" - <<'PYCODE'
import json, sys, time
sys.path.insert(0, "bench")
sys.path.insert(0, ".")
import torch
from common import emit
if not torch.cuda.is_available():
    print(json.dumps({"bench": "gpu_check", "error": "no CUDA device"}))
    sys.exit(2)
from shared.config import CacheConfig, EngineConfig, ModelConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.models.loader import build_model

cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 2048,
                             "intermediate_size": 5632, "num_hidden_layers": 20, "num_attention_heads": 16,
                             "num_key_value_heads": 8, "max_position_embeddings": 4096})
model = build_model(cfg, torch.bfloat16, "cuda")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
params = sum(p.numel() for p in model.parameters())
engine = LLMEngine(model, cfg, None, CacheConfig(num_blocks=8192), EngineConfig(max_num_batched_tokens=8192,
                                                                               max_num_seqs=256))
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(5, 30000, (1024,), generator=gen).tolist() for _ in range(16)]
engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0))
torch.cuda.synchronize()
t = time.perf_counter()
engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
torch.cuda.synchronize()
prefill = 16 * 1024 / (time.perf_counter() - t)
batch = [p[:128] for p in prompts] * 4
t = time.perf_counter()
out = engine.generate(batch, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
torch.cuda.synchronize()
decode = sum(len(r["token_ids"]) for r in out) / (time.perf_counter() - t)
emit("gpu_check", "prefill_tokens_per_s", round(prefill, 1), decode_tokens_per_s=round(decode, 1),
     decode_batch=len(batch), parameters=params, device=torch.cuda.get_device_name(0), dtype="bfloat16", tp=1)
PYCODE
