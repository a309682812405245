"""Quality of lossy KV codecs against uncompressed KV on the bundled model (bf16).

For each of N held-out prompts: prefill the prompt, round-trip its KV through
the codec (as the edge would receive it), then teacher-force a continuation
against that KV. Reported per codec, against the exact KV:
- greedy-token agreement over the 64 greedy tokens of the exact run,
- mean KL(exact ‖ codec) of the next-token distributions at those positions,
- perplexity change on the real held-out continuation (64 tokens).

`--model models/pystd-mla` measures the trained MLA model instead (its latent KV: plane "latent", the
compressed part, and plane "rope", the rotary key part) and writes `kv_quality_mla.json`. A lossy codec's
row `CODEC` is what the wire does (the rope plane one step finer: `protocol/kv.py` `plane_codecs`);
`CODEC:uniform` codes both planes alike, `CODEC:latent` / `CODEC:rope` only one of them (the other exact):
which is how that per-part precision was chosen.

Rows `pool:int8` and `pool:fp8` measure the edge's quantized KV pool (`--kv-cache-dtype`) instead: every
token's K/V, the prompt's and the continuation's, stored in one byte with a scale per token and head (a codec
changes only the prompt's KV, once, as it crosses the link).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from common import ROOT, emit, progress

import torch

from edgecore.protocol.codecs import CODECS, PlaneInfo
from edgecore.protocol.kv import plane_codecs
from edgecore.shared.models.config import CacheConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.sequence import Sequence
from edgecore.shared.kv.wire import DTYPE_NAMES, from_bits, to_bits

TARGETS = {"int8": {"agreement": 0.97, "ppl_increase": 0.005}, "int4": {"ppl_increase": 0.03}}


@torch.inference_mode()
def continuation_logits(engine: LLMEngine, prompt: list[int], cont: list[int],
                        codec: str | tuple[str | None, str | None] | None) -> torch.Tensor:
    """Logits predicting cont[1:], computed over the prompt's KV after a codec round trip (one codec for both
    planes, or one per plane, None keeping that plane exact)."""
    seq = Sequence("q", prompt + cont, SamplingParams())
    engine.block_manager.allocate_prompt(seq.table, seq.token_ids, seq.num_tokens)
    try:
        for n in (len(prompt), len(cont)):
            _, ids, pos, meta = engine.runner.prepare([(seq, n)])
            hidden = engine.model(ids, pos, meta)
            if n == len(prompt) and codec is not None:
                slots = engine.pool.slots(seq.table.blocks, 0, len(prompt))
                dtype = DTYPE_NAMES[engine.dtype]
                names = codec if isinstance(codec, tuple) else (codec, codec)
                for layer in range(engine.config.num_hidden_layers):
                    k, v = engine.pool.read(layer, slots)
                    planes = []
                    for kind, t, name in (("k", k, names[0]), ("v", v, names[1])):
                        if name is None:
                            planes.append(t)
                            continue
                        impl = CODECS[name]
                        bits = to_bits(t)[None]
                        info = PlaneInfo(dtype, bits.shape, kind, 0, len(prompt))
                        planes.append(from_bits(impl.decode(bytes(impl.encode(bits, info)), info), dtype)[0])
                    engine.pool.write(layer, slots, planes[0], planes[1])
            seq.num_computed_tokens += n
        return engine.model.compute_logits(hidden[:-1]).float()
    finally:
        engine.block_manager.free_table(seq.table)


def quality_row(engine, prompts, greedy, windows, exact_g, ppl, base_ppl, prompt_len, codec) -> dict:
    agree = total = 0
    kl_sum = 0.0
    comp_h = []
    for p, g, w, ref in zip(prompts, greedy, windows, exact_g):
        got = continuation_logits(engine, p, g, codec)
        agree += (got.argmax(-1) == ref.argmax(-1)).sum().item()
        total += got.shape[0]
        lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
        kl_sum += (lp.exp() * (lp - lq)).sum(-1).sum().item()
        comp_h.append(continuation_logits(engine, p, w[prompt_len:], codec))
    codec_ppl = ppl(comp_h, windows)
    return {"agreement": round(agree / total, 4), "mean_kl": round(kl_sum / total, 6),
            "ppl": round(codec_ppl, 4), "ppl_increase": round(codec_ppl / base_ppl - 1, 5)}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default=str(ROOT / "models" / "pydoc-llama"))
    args = ap.parse_args()
    model = Path(args.model)
    engine = LLMEngine.from_dir(model, "bf16", "cpu", CacheConfig(num_blocks=2048))
    mla = engine.config.mla is not None
    ids = engine.tokenizer.encode((model / "heldout.txt").read_text())
    stride = (len(ids) - args.prompt_len - args.new_tokens) // args.prompts
    windows = [ids[i * stride: i * stride + args.prompt_len + args.new_tokens] for i in range(args.prompts)]
    prompts = [w[:args.prompt_len] for w in windows]
    progress(f"{model.name}: {len(prompts)} prompts of {args.prompt_len} tokens; exact greedy continuations")
    greedy = [r["token_ids"] for r in engine.generate(prompts, SamplingParams(
        max_tokens=args.new_tokens, temperature=0, ignore_eos=True))]
    exact_g = [continuation_logits(engine, p, g, None) for p, g in zip(prompts, greedy)]
    exact_h = [continuation_logits(engine, p, w[args.prompt_len:], None) for p, w in zip(prompts, windows)]

    def ppl(logit_list, windows_):
        nll, count = 0.0, 0
        for logits, w in zip(logit_list, windows_):
            target = torch.tensor(w[args.prompt_len + 1:])
            nll -= logits.log_softmax(-1).gather(1, target[:, None]).sum().item()
            count += len(target)
        return math.exp(nll / count)

    base_ppl = ppl(exact_h, windows)
    runs: dict[str, str | tuple[str | None, str | None]] = {c: c for c in CODECS if c != "raw"}
    if mla:       # as on the wire (per-part precision), both parts alike, one part only (the other exact)
        for c in [c for c in CODECS if not CODECS[c].lossless]:
            runs[c] = plane_codecs(c, latent=True)
            runs[f"{c}:uniform"], runs[f"{c}:latent"], runs[f"{c}:rope"] = (c, c), (c, None), (None, c)
    rows = {}
    for key, codec in runs.items():     # every codec and level (keys with RoPE in: see kv_rd.py)
        rows[key] = quality_row(engine, prompts, greedy, windows, exact_g, ppl, base_ppl, args.prompt_len, codec)
        rows[key]["target"] = None if mla else TARGETS.get(key)
        progress(f"{key}: {rows[key]}")
    for kind in () if mla else ("int8", "fp8"):     # the edge's quantized KV pool (--kv-cache-dtype): every
        pooled = LLMEngine.from_dir(model, "bf16", "cpu", CacheConfig(num_blocks=2048, kv_dtype=kind))   # token's KV
        key = f"pool:{kind}"
        rows[key] = quality_row(pooled, prompts, greedy, windows, exact_g, ppl, base_ppl, args.prompt_len, None)
        rows[key]["target"] = None
        progress(f"{key}: {rows[key]}")
    emit("kv_quality_mla" if mla else "kv_quality", "int8_agreement", rows["int8"]["agreement"],
         model=model.name, base_ppl=round(base_ppl, 4), codecs=rows, prompts=len(prompts),
         prompt_tokens=args.prompt_len, new_tokens=args.new_tokens)


if __name__ == "__main__":
    main()
