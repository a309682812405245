"""The disk KV tier after a restart: time to first token of prompts that repeat a long prefix, served from the
tier (read back, checked, decoded) against a fresh engine without one (recomputed), and the tier's read speed.

One process, in-process `LLMEngine`s on CPU (one torch thread): engine A, with a tier in a fresh temporary
directory, prefills `--prompts` prompts of a `--prefix`-token prefix plus a short suffix, and is closed (its
cached blocks go to the tier); engine B, restarted on the same directory, and engine C, without a tier, then
serve each prefix again with a new suffix, B and C alternating prompt by prompt. The model is a random-weight
Llama of realistic proportions built here (`--model synthetic`, the default) or the bundled tiny one
(`--model bundled`, where prefill is so cheap that reading a block costs about as much as computing it).
Reported: TTFT per configuration (median, and each), their ratio, blocks hit, tier bytes read and the reader's
MB/s (bytes / reader seconds), bytes on disk per token, and that B's tokens equal C's (lossless tier).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from common import ROOT, emit, progress

from edgecore.shared.models.config import CacheConfig, EngineConfig, ModelConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.loader import build_model

SUFFIX = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


SYNTHETIC = {"architectures": ["LlamaForCausalLM"], "vocab_size": 4096, "hidden_size": 768, "intermediate_size": 2048,
             "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}     # (bench/peer_pull.py uses it too)


def synthetic_model() -> tuple[torch.nn.Module, ModelConfig]:
    """The random-weight Llama of realistic proportions (seed 0: the same weights each call), float32 on CPU."""
    config = ModelConfig.from_dict(SYNTHETIC)
    torch.manual_seed(0)
    model = build_model(config, torch.float32, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model, config


def make_engine(kind: str, cache: CacheConfig) -> LLMEngine:
    if kind == "bundled":
        return LLMEngine.from_dir(ROOT / "models" / "pydoc-llama", "fp32", "cpu", cache, EngineConfig())
    model, config = synthetic_model()
    return LLMEngine(model, config, None, cache, EngineConfig(), fingerprint="bench-synthetic-llama")


def first_token(engine: LLMEngine, rid: str, ids: list[int]) -> tuple[float, list[int], int]:
    """(seconds to the first token, all tokens, cached prompt tokens reported)."""
    start = time.perf_counter()
    engine.add_request(rid, ids, GREEDY)
    ttft, tokens, cached = None, [], -1
    while engine.has_unfinished():
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft, cached = time.perf_counter() - start, out.num_cached_tokens
            tokens += out.new_token_ids
    assert ttft is not None
    return ttft, tokens, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("synthetic", "bundled"), default="synthetic",
                    help="synthetic: a random 6-layer Llama (768 wide) built here (default); bundled: pydoc-llama")
    ap.add_argument("--prompts", type=int, default=4, help="distinct long prefixes (default 4)")
    ap.add_argument("--prefix", type=int, default=768, help="tokens of each prefix (default 768)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--codec", default="lossless", help="the tier's codec (--kv-tier-codec; default lossless)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    vocab = 2000 if args.model == "bundled" else 4000
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.prefix)] for _ in range(args.prompts)]
    suffix = [[rng.randrange(3, vocab) for _ in range(SUFFIX)] for _ in range(2 * args.prompts)]
    blocks = (args.prompts * (args.prefix + SUFFIX + 8)) // 16 + 8
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as tier_dir:
        tiered = CacheConfig(num_blocks=blocks, tier_dir=tier_dir, tier_bytes=1 << 34, tier_codec=args.codec)
        progress(f"engine A ({args.model}): {args.prompts} prompts of {args.prefix}+{SUFFIX} tokens, then closed")
        a = make_engine(args.model, tiered)
        for i, p in enumerate(prefixes):
            first_token(a, f"a{i}", p + suffix[i])
        a.close()
        b = make_engine(args.model, tiered)               # restarted on the same directory
        c = make_engine(args.model, CacheConfig(num_blocks=blocks))
        rows = []
        for i, p in enumerate(prefixes):
            ids = p + suffix[args.prompts + i]
            tb, tokens_b, cached_b = first_token(b, f"b{i}", ids)
            tc, tokens_c, cached_c = first_token(c, f"c{i}", ids)
            rows.append({"tier_ttft_s": round(tb, 4), "no_tier_ttft_s": round(tc, 4), "cached_tokens": cached_b,
                         "same_tokens": tokens_b == tokens_c})
            progress(f"prompt {i}: tier {tb * 1e3:.1f} ms ({cached_b} cached), no tier {tc * 1e3:.1f} ms "
                     f"({cached_c} cached)")
        s = b.stats()
        b.close()
        c.close()
    tier = statistics.median(r["tier_ttft_s"] for r in rows)
    plain = statistics.median(r["no_tier_ttft_s"] for r in rows)
    read_mbps = s.tier_read_bytes / s.tier_read_seconds / 1e6 if s.tier_read_seconds else 0.0
    kv_per_token = a.kv_bytes_per_token
    emit("kv_tier", "ttft_speedup_after_restart", round(plain / tier, 2),
         model=args.model, codec=args.codec, prompts=args.prompts, prefix_tokens=args.prefix, suffix_tokens=SUFFIX,
         threads=args.threads, ttft_tier_median_s=round(tier, 4), ttft_no_tier_median_s=round(plain, 4),
         tier_hit_blocks=s.tier_hit_blocks, tier_miss_blocks=s.tier_miss_blocks,
         tier_read_bytes=s.tier_read_bytes, tier_read_MBps=round(read_mbps, 1),
         tier_bytes_per_token=round(s.tier_used_bytes / max(1, s.tier_files * 16), 1),
         raw_kv_bytes_per_token=kv_per_token, same_tokens=all(r["same_tokens"] for r in rows), rows=rows)


if __name__ == "__main__":
    main()
