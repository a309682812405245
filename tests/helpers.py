"""Test helpers: step-by-step logits from our runtime, random HF checkpoints."""

from __future__ import annotations

import torch

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.sequence import Sequence


def stepwise_logits(engine, token_ids: list[int], prefill_len: int) -> torch.Tensor:
    """Logits at every position from prefill_len-1 on: one prefill of `prefill_len`
    tokens, then one decode step per remaining token (teacher forcing)."""
    seq = Sequence("probe", token_ids, SamplingParams(max_tokens=1))
    engine.block_manager.allocate_prompt(seq.table, token_ids, len(token_ids))
    rows = []
    with torch.inference_mode():
        steps = [prefill_len] + [1] * (len(token_ids) - prefill_len)
        for n in steps:
            _, ids, pos, meta = engine.runner.prepare([(seq, n)])
            hidden = engine.model(ids, pos, meta)
            rows.append(engine.model.compute_logits(hidden[-1:]))
            seq.num_computed_tokens += n
    engine.block_manager.free_table(seq.table)
    return torch.cat(rows)


HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"), "llama4": ("Llama4TextConfig", "Llama4ForCausalLM"),
}


def random_hf_checkpoint(tmp_path, arch: str, **overrides):
    """Save a small random transformers model (safetensors) and return (dir, hf_model)."""
    import transformers

    base = dict(vocab_size=257, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    base.update(overrides)
    cfg_cls, cls = HF_CLASSES[arch]
    cfg_cls, cls = getattr(transformers, cfg_cls), getattr(transformers, cls)
    torch.manual_seed(0)
    model = cls(cfg_cls(**base)).eval()
    with torch.no_grad():   # make biases and norms non-trivial so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


def teacher_forced_decode(engine, lengths: list[int], steps: int, check) -> int:
    """Prefill sequences of `lengths` random tokens through the model, then decode `steps` steps of all of them
    at once, each step through `check(items)` (which must run the step: it writes the K/V the next one reads);
    tokens come from the prompts (teacher-forced). Returns the steps run; the blocks are freed."""
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(2, engine.config.vocab_size, (n + steps,), generator=gen).tolist()
        seq = Sequence(f"s{i}", ids, SamplingParams(max_tokens=1))
        engine.block_manager.allocate_prompt(seq.table, ids, len(ids))
        seqs.append(seq)
    try:
        with torch.inference_mode():
            for seq, n in zip(seqs, lengths):
                _, ids, pos, meta = engine.runner.prepare([(seq, n)])
                engine.model(ids, pos, meta)
                seq.num_computed_tokens += n
            for _ in range(steps):
                check([(s, 1) for s in seqs])
                for s in seqs:
                    s.num_computed_tokens += 1
    finally:
        for s in seqs:
            engine.block_manager.free_table(s.table)
    return steps
