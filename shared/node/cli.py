"""`edgecore generate`: run the engine in this process and stream text to stdout."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from edgecore.shared.node.env import default_model, resolve_device

if TYPE_CHECKING:
    from edgecore.shared.models.config import CacheConfig, ModelConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model directory, or a .gguf file (default: the bundled pydoc-llama)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="weight and KV dtype (auto: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="quantize the float weights at load, weight-only (CPU): int8 per output row, int4 per 32 "
                        "inputs (default: keep the checkpoint's weights)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding by prompt lookup, as vLLM's flag: e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (default: off)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="the KV pool's values: the model's dtype (auto), or one byte each with a scale per token "
                        "and head")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="speculative decoding with this small model drafting (same tokenizer as --model)")


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step with torch.compile (CPU, small float32 Llama-family models: about "
                        "1.3-1.9x faster steps at 1-64 sequences; a minute of start-up the first time, cached after; "
                        "needs a C++ compiler)")


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    from edgecore.shared.kv.budget import DEFAULT_KV_CACHE_MEMORY
    p.add_argument("--kv-cache-memory", default=DEFAULT_KV_CACHE_MEMORY, metavar="SIZE",
                   help="memory for the KV cache, e.g. 512MiB or 4GiB: the pool holds as many 16-token blocks as "
                        f"fit (default {DEFAULT_KV_CACHE_MEMORY}); on CPU it becomes resident only as it fills")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks of 16 tokens, instead of sizing the cache from --kv-cache-memory")


def kv_cache_memory(args: argparse.Namespace) -> int | None:
    """--kv-cache-memory in bytes, or None when --kv-blocks sets the size; either flag checked (ConfigError),
    so a node's front process can refuse a bad value before it starts anything."""
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.kv.budget import parse_size
    kv_tier(args)
    if args.kv_blocks is not None:
        if args.kv_blocks < 1:
            raise ConfigError(f"--kv-blocks must be at least 1, not {args.kv_blocks}")
        return None
    try:
        return parse_size(args.kv_cache_memory)
    except ValueError as exc:
        raise ConfigError(f"--kv-cache-memory: {exc}") from None


def kv_tier(args: argparse.Namespace) -> tuple[str | None, int, str]:
    """--kv-tier-dir, --kv-tier-size in bytes and --kv-tier-codec, checked (ConfigError); (None, 0, codec) without
    a tier (a command without these flags: the same)."""
    from edgecore.protocol.codecs import CODECS
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.kv.budget import parse_size
    directory, codec = getattr(args, "kv_tier_dir", None), getattr(args, "kv_tier_codec", "lossless")
    if codec not in CODECS:
        raise ConfigError(f"--kv-tier-codec: unknown codec '{codec}' (known: {', '.join(CODECS)})")
    if directory is None:
        return None, 0, codec
    try:
        size = parse_size(getattr(args, "kv_tier_size", "8GiB"))
    except ValueError as exc:
        raise ConfigError(f"--kv-tier-size: {exc}") from None
    if size < 1:
        raise ConfigError("--kv-tier-size must be more than 0 bytes")
    return directory, size, codec


def kv_cache_config(args: argparse.Namespace, config: ModelConfig, value_bytes: float,
                    tp: int = 1) -> tuple[CacheConfig, str]:
    """The CacheConfig from --kv-blocks or --kv-cache-memory and --kv-resident-memory (a bound above the budget
    is the budget) and --kv-cache-dtype, and the start-up line that says what a deployment gets (for the log,
    once the node starts); a size that holds no block is a ConfigError."""
    from edgecore.shared.models.config import CacheConfig
    from edgecore.shared.errors import ConfigError
    from edgecore.shared.kv.budget import describe, kv_blocks, parse_size
    block_size = CacheConfig.block_size
    kv_dtype = getattr(args, "kv_cache_dtype", "auto")
    kv_dtype = None if kv_dtype == "auto" else kv_dtype
    if kv_dtype is not None:
        if config.mla is not None:
            raise ConfigError(f"--kv-cache-dtype {kv_dtype}: not for MLA models (their latent KV cache stays in the "
                              "model's dtype)")
        value_bytes = 1 + 2 / config.head_dim         # a byte per value, a float16 scale per token and head
    memory = kv_cache_memory(args)
    if memory is None:
        blocks = args.kv_blocks
    else:
        try:
            blocks = kv_blocks(config, value_bytes, block_size, memory, tp)
        except ValueError as exc:
            raise ConfigError(f"--kv-cache-memory: {exc}") from None
    resident: int | None = None
    bound = getattr(args, "kv_resident_memory", None)
    if bound is not None:
        try:
            resident = min(blocks, kv_blocks(config, value_bytes, block_size, parse_size(bound), tp))
        except ValueError as exc:
            raise ConfigError(f"--kv-resident-memory: {exc}") from None
    tier_dir, tier_bytes, tier_codec = kv_tier(args)
    return (CacheConfig(num_blocks=blocks, resident_blocks=resident, tier_dir=tier_dir, tier_bytes=tier_bytes,
                        tier_codec=tier_codec, kv_dtype=kv_dtype),
            describe(config, value_bytes, block_size, blocks, tp, resident))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt in this process",
                       description="Load a model and stream a completion of --prompt to stdout.")
    add_model_args(p)
    add_compile_arg(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=run_generate)

    p = sub.add_parser("pack", help="losslessly compress a checkpoint for shipping to edges",
                       description="Write a packed checkpoint: bf16/fp16/fp32 tensors cut into chunks, each "
                                   "split into a top-byte plane (sign and high exponent bits, zstd-coded) and "
                                   "the other bytes (stored); a CRC-32 per chunk.")
    p.add_argument("model_dir", help="Hugging Face model directory (safetensors)")
    p.add_argument("out_dir", help="where to write the packed checkpoint")
    p.add_argument("--level", type=int, default=None,
                   help="plain zstd level for the top-byte planes (default: literal-only optimal parsing, "
                        "smallest and fastest to load, slower to pack)")
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=run_pack)

    p = sub.add_parser("unpack", help="restore the original safetensors files from a packed checkpoint",
                       description="Rewrite the original safetensors files byte for byte (SHA-256 checked).")
    p.add_argument("packed_dir")
    p.add_argument("out_dir")
    p.set_defaults(func=run_unpack)


class Progress:
    """One self-overwriting status line on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str):
        self.label = label
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, message: str) -> None:
        import time
        now = time.monotonic()
        if self.tty:
            sys.stderr.write(f"\r{self.label}: {message}\x1b[K")
        elif now - self.last >= 1.0:
            sys.stderr.write(f"{self.label}: {message}\n")
        else:
            return
        self.last = now
        sys.stderr.flush()

    def done(self, message: str) -> None:
        sys.stderr.write(("\r" if self.tty else "") + f"{self.label}: {message}" + ("\x1b[K" if self.tty else "")
                         + "\n")


def run_pack(args: argparse.Namespace) -> int:
    from pathlib import Path

    from edgecore.shared.pack import pack_model
    from edgecore.shared.errors import ConfigError, ModelLoadError
    if args.threads < 1:
        raise ConfigError(f"--threads must be at least 1, not {args.threads}")
    if args.level is not None and not -(1 << 17) <= args.level <= 22:
        raise ConfigError(f"--level must be a zstd level from -131072 to 22, not {args.level}")
    progress = Progress("pack")
    try:
        manifest = pack_model(args.model_dir, args.out_dir, args.level, args.threads, progress)
    except OSError as exc:           # an output path that is a file, unwritable, ...
        raise ModelLoadError(f"packing into {args.out_dir} failed: {exc}") from None
    original = sum(s["size"] for s in manifest["shards"])
    packed = manifest["files"]["model.edgepack"]["size"]
    progress.done(f"{len(manifest['tensors'])} tensors, {original / 1e6:.1f} MB → {packed / 1e6:.1f} MB "
                  f"({packed / max(1, original):.3f}×) in {Path(args.out_dir)}")
    return 0


def run_unpack(args: argparse.Namespace) -> int:
    from edgecore.shared.errors import ModelLoadError
    from edgecore.shared.pack import PackedCheckpoint, is_packed
    if not is_packed(args.packed_dir):
        raise ModelLoadError(f"{args.packed_dir} is not a packed checkpoint (no edgecore-pack.json)")
    progress = Progress("unpack")
    packed = PackedCheckpoint(args.packed_dir)
    try:
        packed.unpack(args.out_dir, progress)
    except OSError as exc:
        raise ModelLoadError(f"unpacking into {args.out_dir} failed: {exc}") from None
    finally:
        packed.close()
    progress.done(f"restored {len(packed.manifest['shards'])} safetensors file(s) in {args.out_dir}")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from edgecore.shared.engine.engine import LLMEngine
    from edgecore.shared.engine.sampling_params import SamplingParams

    from edgecore.shared.models.config import CacheConfig, EngineConfig, SpeculativeConfig
    from edgecore.shared.errors import ConfigError
    kv_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    engine = LLMEngine.from_dir(args.model or default_model(), args.dtype, resolve_device(args.device),
                                cache_config=CacheConfig(kv_dtype=kv_dtype),
                                engine_config=EngineConfig(compile_decode=args.compile, quantize=args.quantize,
                                                           speculative=SpeculativeConfig.parse(args.speculative_config,
                                                                                               args.draft_model)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompt = args.prompt
    if args.chat:
        if engine.tokenizer is None:        # a checkpoint without tokenizer files: no chat template either
            raise ConfigError("--chat needs a model with a tokenizer (tokenizer.json)")
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    engine.add_request("cli", prompt, params)
    sys.stdout.write(args.prompt if not args.chat else "")
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
