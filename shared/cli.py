"""`edgecore generate`: run the engine in this process and stream text to stdout."""

from __future__ import annotations

import argparse
import sys

from shared.env import default_device, default_model


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model directory (default: the bundled pydoc-llama)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="weight and KV dtype (auto: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt in this process",
                       description="Load a model and stream a completion of --prompt to stdout.")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_dir(args.model or default_model(), args.dtype, args.device or default_device())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    engine.add_request("cli", prompt, params)
    sys.stdout.write(args.prompt if not args.chat else "")
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
