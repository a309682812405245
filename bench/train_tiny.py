"""Train `pystd-llama`, the second small model the KV codecs are measured on.

Life cycle: collect the corpus (Python's own standard-library sources under the
running interpreter, sorted paths; every file whose path hashes to 0 mod 40 is
held out), train a byte-level BPE tokenizer on the training files, train a small
Llama with `transformers` on one thread for a number of steps or a time budget,
whichever ends first (the learning rate follows a cosine over that), and write a
Hugging Face model directory (bf16 safetensors, tokenizer, chat template,
`heldout.txt` from the held-out files, README with the losses).

It differs from the bundled pydoc-llama in what the KV codecs see: head_dim 64
instead of 32, 3 layers instead of 4, a code tokenizer of 1024 tokens instead of
a prose one of 2048, and source code rather than documentation.

    .venv/bin/python bench/train_tiny.py --out models/pystd-llama   # ~13 min, 1 thread

`--arch deepseek` trains `pystd-mla` instead, on the same corpus with pystd-llama's tokenizer (`--tokenizer`):
a DeepSeek-V3 model of the same hidden size (256, 3 layers, 4 heads) with multi-head latent attention
(kv_lora_rank 64, qk_rope_head_dim 16: 80 cached values per token per layer against pystd-llama's 256), one
dense first layer and two MoE layers of 4 routed experts (2 per token, sigmoid routing) plus a shared one:

    .venv/bin/python bench/train_tiny.py --arch deepseek --tokenizer models/pystd-llama --out models/pystd-mla
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def corpus(root: Path) -> tuple[list[str], list[str]]:
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "/test" in "/" + rel or "idlelib" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 40 == 0 else train).append(text)
    return train, held


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])])
    return tok


def encode_all(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(1)   # <|eos|> between files
    return torch.tensor(ids, dtype=torch.long)


def make_deepseek(vocab: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=vocab, hidden_size=256, intermediate_size=640, moe_intermediate_size=256,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                           topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, kv_lora_rank=64,
                           q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                           max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0)
    return DeepseekV3ForCausalLM(cfg)


def make_model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=640, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0,
                      eos_token_id=1, attention_bias=False, hidden_act="silu")
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, seq: int, batches: int = 8) -> float:
    model.eval()
    n = (len(data) - 1) // seq
    idx = torch.linspace(0, n - 1, steps=min(n, batches * 8)).long()
    losses = []
    for chunk in idx.split(8):
        x = torch.stack([data[i * seq:(i + 1) * seq] for i in chunk.tolist()])
        losses.append(model(input_ids=x, labels=x).loss.item())
    model.train()
    return sum(losses) / len(losses)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/pystd-llama")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arch", choices=["llama", "deepseek"], default="llama")
    ap.add_argument("--tokenizer", help="a model directory whose tokenizer.json to reuse instead of training one")
    ap.add_argument("--max-minutes", type=float, default=13.0, help="stop early (and say so) past this")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    root = Path(sys.prefix if not hasattr(sys, "base_prefix") else sys.base_prefix) / "lib" / \
        f"python{sys.version_info.major}.{sys.version_info.minor}"
    train_texts, held_texts = corpus(root)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = (Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json")) if args.tokenizer
           else train_tokenizer(train_texts, args.vocab))
    data, held = encode_all(tok, train_texts), encode_all(tok, held_texts)
    print(f"corpus {root}: {len(train_texts)} files, {len(data)} tokens; held out {len(held_texts)} files, "
          f"{len(held)} tokens", file=sys.stderr)
    model = (make_deepseek if args.arch == "deepseek" else make_model)(tok.get_vocab_size())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    t0, step = time.time(), 0
    for step in range(1, args.steps + 1):
        # cosine over whichever runs out first, the steps or the time budget (a shared machine is slow)
        done = max(step / args.steps, (time.time() - t0) / (args.max_minutes * 60))
        lr = args.lr * min(1.0, step / 30) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        for g in opt.param_groups:
            g["lr"] = max(lr, args.lr * 0.02)
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        if time.time() - t0 > args.max_minutes * 60:
            print(f"stopping at step {step}: time limit", file=sys.stderr)
            break
    minutes = (time.time() - t0) / 60
    train_loss, held_loss = eval_loss(model, data, args.seq), eval_loss(model, held, args.seq)
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
        "pad_token": SPECIAL[2], "add_bos_token": True, "chat_template": TEMPLATE, "model_max_length": 1024},
        indent=2) + "\n")
    (out / "heldout.txt").write_text("\n\n".join(held_texts)[:60000])
    params = sum(p.numel() for p in model.parameters())
    summary = {"params": params, "steps": step, "minutes": round(minutes, 1), "train_loss": round(train_loss, 3),
               "heldout_loss": round(held_loss, 3), "train_tokens": len(data), "threads": args.threads,
               "arch": args.arch}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
