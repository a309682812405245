"""A tiny random Llama checkpoint and PEFT LoRA adapters for it (tests of shared/models/lora.py, the edge and the core).

`build(root)` saves the base model (transformers; the bundled model's tokenizer and vocabulary size) under root/base and three adapters made with peft's
`LoraConfig` under root/<name>, each with non-zero random B (peft starts B at zero): `attn` (q/k/v/o, r=4),
`mlp` (gate/up/down, r=8, use_rslora) and `all` (every projection, r=16, lora_alpha 8). `reference(root, name,
prompt, n)` gives transformers + peft's greedy float32 tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.conftest import MODEL_DIR
from tests.helpers import random_hf_checkpoint

ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]),
}


def build(root: Path) -> Path:
    """Base model at root/base, adapters at root/<name>; returns root."""
    from peft import LoraConfig, get_peft_model
    base_dir, model = random_hf_checkpoint(root / "base", "llama", vocab_size=2048, max_position_embeddings=256)
    for name in ("tokenizer.json", "tokenizer_config.json"):      # the bundled model's: text prompts work too
        shutil.copy(MODEL_DIR / name, base_dir / name)
    for i, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, bias="none", **options),  # type: ignore[arg-type]
                                    adapter_name="default")
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn_like(p) * 0.3)
        peft_model.save_pretrained(root / name)
        model = peft_model.unload()       # the base back, adapters removed
    return root


def reference(root: Path, name: str | None, prompt: list[int], n: int) -> list[int]:
    """transformers (+ peft with adapter `name`) greedy float32 continuation of `prompt`, `n` tokens."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "base", torch_dtype=torch.float32).eval()
    if name is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, root / name).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
