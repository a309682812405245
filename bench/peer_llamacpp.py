"""edgecore against llama.cpp on this CPU: decode at batch 1/8/32/64, prefill, HTTP serving, memory.

Builds llama.cpp's own tools (llama-batched-bench, llama-server) from the vendored source of a pinned
llama-cpp-python source distribution on the package index (checked by sha256), cached under
~/.cache/edgecore-bench/; converts the bundled model and a random-weight ~1 GB Llama to GGUF (f32)
with that source's converter (the bundled tokenizer splits like GPT-2, so an unknown pre-tokenizer
hash maps to `gpt-2`); then alternates the engines over `--rounds` rounds:
- decode: 128-token prompts, 128 new tokens, 1/8/32/64 sequences (llama-batched-bench `S_TG`
  against the engine's generated tokens/s over the decode phase);
- prefill: one 512-token prompt (`S_PP` against the engine's prompt tokens/s);
- HTTP: `--clients` streaming clients, one connection per request for both servers (llama-server
  closes it after each stream), the same prompts; tokens/s, TTFT and ITL percentiles, peak RSS of
  each server's process tree (sampled every 50 ms); for edgecore also of the HTTP frontend and the engine
  process apart, and the engine's own memory from its /stats: weights, the KV pool's resident part (blocks
  ever used; the pool maps its capacity lazily) and everything else (the interpreter, torch, activations).
Both use `--threads` threads (2) and float32. Ratios are edgecore ÷ llama.cpp, medians over rounds.
edgecore runs twice on the bundled model, eager and with its decode step compiled (`--compile`, the
`_compiled` fields and the HTTP server `edgecore_compiled`); the ~1 GB model has no compiled step
(its weights are too large for the compiled form), so it runs eagerly only. The speculative-decoding rows
(prompt lookup in both engines on the same GGUF file) are bench/speculative_llamacpp.py's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from common import ROOT, emit, progress

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CACHE = Path(os.environ.get("EDGECORE_BENCH_CACHE", Path.home() / ".cache" / "edgecore-bench"))
TOOLS = ("llama-server", "llama-batched-bench")
MODEL = ROOT / "models" / "pydoc-llama"


# ---- llama.cpp: source, build, conversion --------------------------------------------------
def source_dir() -> Path:
    src = CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if src.is_dir():
        return src
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
    if not tarball.is_file():
        # pip, not PyPI's JSON API: it reads the index this machine is configured for (a mirror answers
        # the simple API only), and fetches the source distribution alone.
        progress(f"downloading the llama-cpp-python {VERSION} source distribution")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(CACHE)], check=True,
                       stdout=subprocess.DEVNULL)
    if hashlib.sha256(tarball.read_bytes()).hexdigest() != SHA256:
        raise SystemExit(f"{tarball}: sha256 mismatch")
    with tarfile.open(tarball) as tar:
        tar.extractall(CACHE, filter="data")
    return src


def build() -> Path:
    src = source_dir()
    out = src / "build" / "bin"
    if all((out / t).is_file() for t in TOOLS):
        return out
    progress("building llama.cpp (cmake Release, native; ~15 min on 2 cores, cached afterwards)")
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
                    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(src / "build"), "-j", str(os.cpu_count() or 2), "--target", *TOOLS],
                   check=True, stdout=subprocess.DEVNULL)
    return out


CONVERT = """
import sys
sys.path.insert(0, sys.argv[1] + "/gguf-py"); sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as c
try:
    from conversion.base import TextModel      # newer sources split the converter into a package
except ImportError:
    TextModel = c.TextModel
orig = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:      # a byte-level BPE that splits like GPT-2
        return "gpt-2"
TextModel.get_vocab_base_pre = pre
sys.argv = ["convert", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32"]
c.main()
"""


def to_gguf(model_dir: Path, name: str) -> Path:
    out = CACHE / f"{name}-f32.gguf"
    if not out.is_file():
        progress(f"converting {model_dir} to GGUF")
        subprocess.run([sys.executable, "-c", CONVERT, str(source_dir()), str(model_dir), str(out)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def synthetic_model() -> Path:
    """A random-weight Llama of ~1 GB in float32, with the bundled tokenizer (seeded, cached)."""
    out = CACHE / "synthetic-1gb"
    if (out / "model.safetensors").is_file():
        return out
    import shutil

    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=1536, intermediate_size=4096, num_hidden_layers=10,
                                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / f, out / f)
    return out


# ---- decode and prefill --------------------------------------------------------------------
def llamacpp_batched(bin_dir: Path, gguf: Path, threads: int, npp: int, ntg: int, npl: list[int]) -> dict:
    ctx = max(npl) * (npp + ntg) + 256
    for _ in range(3):      # its table has been seen missing from a run's output once in a while: run again
        r = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads),
                            "-tb", str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(npp),
                            "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), "-fa", "off"],
                           capture_output=True, text=True, check=True)
        rows = {}
        for line in r.stdout.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 8 and cells[2].isdigit():
                rows[int(cells[2])] = {"S_PP": float(cells[5]), "S_TG": float(cells[7])}
        if all(b in rows for b in npl):
            return rows
    raise SystemExit(f"llama-batched-bench printed no row for {npl} (npp {npp}, ntg {ntg}):\n{r.stdout[-2000:]}")


def engine_batched(engine, prompt_ids: list[int], npp: int, ntg: int, npl: list[int]) -> dict:
    from edgecore.shared.engine.sampling_params import SamplingParams
    rows = {}
    for b in npl:
        prompts = [prompt_ids[i * 7: i * 7 + npp] for i in range(b)]
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
        full = SamplingParams(max_tokens=ntg, temperature=0, ignore_eos=True, detokenize=False)
        engine.generate(prompts[:1], one)                                # warm
        t = time.perf_counter()
        engine.generate(prompts, one)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        engine.generate(prompts, full)
        total = time.perf_counter() - t
        rows[b] = {"S_PP": b * npp / prefill, "S_TG": b * (ntg - 1) / max(1e-9, total - prefill)}
    return rows


# ---- HTTP ----------------------------------------------------------------------------------
def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return total


async def http_load(port: int, prompts, clients: int, duration: float, max_tokens: int, pid: int,
                    parts: dict[str, int]) -> dict:
    """`parts`: processes whose own peak RSS is reported too (name → pid)."""
    import asyncio
    import random

    import aiohttp
    ttft, itl, errors, tokens, peak = [], [], 0, 0, 0
    part_peak = dict.fromkeys(parts, 0)
    stop_at = time.perf_counter() + duration
    rng = random.Random(0)

    async def worker():
        nonlocal errors, tokens
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            while time.perf_counter() < stop_at:
                t0, last, got = time.perf_counter(), None, 0
                body = {"prompt": rng.choice(prompts), "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                try:
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                        if resp.status != 200:
                            errors += 1
                            continue
                        async for line in resp.content:
                            if not line.startswith(b"data: {") or b'"choices":[{' not in line:
                                continue
                            now = time.perf_counter()
                            (ttft if last is None else itl).append(now - (t0 if last is None else last))
                            last, got = now, got + 1
                    tokens += max_tokens if got else 0
                except aiohttp.ClientError:
                    errors += 1

    async def sample():
        nonlocal peak
        while time.perf_counter() < stop_at + 1:
            peak = max(peak, tree_rss(pid))
            for name, part in parts.items():
                part_peak[name] = max(part_peak[name], rss(part))
            await asyncio.sleep(0.05)

    t = time.perf_counter()
    await asyncio.gather(sample(), *(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - t - 1
    return {"tokens_per_s": tokens / elapsed, "errors": errors, "peak_rss_mb": peak / 2**20,
            **{f"peak_rss_{name}_mb": v / 2**20 for name, v in part_peak.items()},
            "ttft_ms": _pcts(ttft), "itl_ms": _pcts(itl)}


def _rounded(d: dict) -> dict:
    return {k: round(v, 1) if isinstance(v, float) else _rounded(v) if isinstance(v, dict) else v
            for k, v in d.items()}


def _pcts(values) -> dict:
    if not values:
        return {}
    v = sorted(values)
    return {f"p{q}": round(v[min(len(v) - 1, int(q / 100 * len(v)))] * 1e3, 2) for q in (50, 90, 99)}


def _wait_http(port: int, path: str, timeout: float = 300) -> None:    # --compile: a first compile
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"server on port {port} did not become ready")


def _stats(port: int) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10).read())


def serve_round(server: str, bin_dir: Path, gguf: Path, prompts, args) -> dict:
    import asyncio
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if server == "llama.cpp":
        ctx = args.clients * (max(len(p) for p in prompts) + args.max_tokens + 16)
        cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads),
               "-c", str(ctx), "-np", str(args.clients), "--port", str(port), "--host", "127.0.0.1", "-fa", "off"]
        ready = "/health"
    else:
        cmd = [sys.executable, "-m", "edgecore", "edge", "--listen", f"127.0.0.1:{port}", "--dtype", "fp32",
               *(["--compile"] if server == "edgecore_compiled" else [])]
        ready = "/health"
    env = {**os.environ, "EDGECORE_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        _wait_http(port, ready)
        idle = tree_rss(proc.pid) / 2**20
        parts = {}
        if server != "llama.cpp":
            parts = {"frontend": proc.pid, "engine": _stats(port)["engine_pid"]}
        result = asyncio.run(http_load(port, prompts, args.clients, args.duration, args.max_tokens, proc.pid,
                                       parts))
        result["idle_rss_mb"] = idle
        if server != "llama.cpp":      # the engine's own memory: weights, the KV pool's resident part, the rest
            stats = _stats(port)
            weights = stats["weights_bytes"] / 2**20
            kv = stats["blocks_touched"] * stats["kv_block_bytes"] / 2**20
            result["engine_memory_mb"] = {
                "weights": weights, "kv_pool_resident": kv,
                "kv_pool_capacity": stats["blocks_total"] * stats["kv_block_bytes"] / 2**20,
                "everything_else": result["peak_rss_engine_mb"] - weights - kv}
        return result
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


# ---- main ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: synthetic (the ~1 GB model), "
                    "decode (decode and prefill), http, compiled (edgecore with --compile)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from edgecore.shared.models.config import CacheConfig, EngineConfig
    from edgecore.shared.engine.engine import LLMEngine
    from edgecore.shared.text.tokenizer import Tokenizer
    bin_dir = build()
    models = {"bundled": MODEL} if "synthetic" in args.skip else {"bundled": MODEL, "synthetic_1gb": synthetic_model()}
    ggufs = {name: to_gguf(path, name) for name, path in models.items()}
    ids = Tokenizer.from_dir(MODEL).encode((MODEL / "heldout.txt").read_text())
    npl = [1, 8, 32, 64]
    report: dict = {"llama_cpp_python": VERSION, "threads": args.threads, "dtype": "f32"}
    for name, path in models.items() if "decode" not in args.skip else ():
        # No prefix cache: every timed prefill computes its prompt, as llama-batched-bench's does.
        variants = ["edgecore"] + (["edgecore_compiled"] if name == "bundled" and "compiled" not in args.skip else [])
        engines = {v: LLMEngine.from_dir(path, "fp32", "cpu", CacheConfig(num_blocks=8192, enable_prefix_caching=False),
                                         EngineConfig(compile_decode=v.endswith("compiled")))
                   for v in variants}
        sizes = npl if name == "bundled" else [1]
        ours: dict[str, list] = {v: [] for v in variants}
        theirs = []
        for r in range(args.rounds):
            progress(f"{name}: round {r + 1}/{args.rounds}")
            for v, engine in engines.items():
                ours[v].append(engine_batched(engine, ids, 128, 128, sizes))
            theirs.append(llamacpp_batched(bin_dir, ggufs[name], args.threads, 128, 128, sizes))
        prefill_ours = [engine_batched(engines["edgecore"], ids, 512, 2, [1])[1]["S_PP"] for _ in range(args.rounds)]
        prefill_theirs = [llamacpp_batched(bin_dir, ggufs[name], args.threads, 512, 2, [1])[1]["S_PP"]
                          for _ in range(args.rounds)]
        decode = {}
        for b in sizes:
            row = {"llama_cpp_tok_s": round(statistics.median(t[b]["S_TG"] for t in theirs), 1)}
            for v in variants:
                suffix = v[len("edgecore"):]
                row[f"edgecore{suffix}_tok_s"] = round(statistics.median(o[b]["S_TG"] for o in ours[v]), 1)
                row[f"ratio{suffix}"] = round(statistics.median(o[b]["S_TG"] / t[b]["S_TG"]
                                                                for o, t in zip(ours[v], theirs)), 3)
            decode[b] = row
        report[name] = {
            "decode": decode,
            "prefill_512": {"edgecore_tok_s": round(statistics.median(prefill_ours), 1),
                            "llama_cpp_tok_s": round(statistics.median(prefill_theirs), 1),
                            "ratio": round(statistics.median(prefill_ours) / statistics.median(prefill_theirs), 3)}}
        del engines
    if "http" not in args.skip:
        rng = __import__("random").Random(1)
        prompts = [ids[s:s + n] for n, s in ((rng.randint(48, 200), rng.randint(0, len(ids) - 201)) for _ in range(200))]
        servers = ["edgecore", "llama.cpp"] + (["edgecore_compiled"] if "compiled" not in args.skip else [])
        rounds: dict[str, list] = {s: [] for s in servers}
        for r in range(args.rounds):
            for server in (servers if r % 2 == 0 else servers[::-1]):
                progress(f"HTTP round {r + 1}/{args.rounds}: {server}, {args.clients} clients, {args.duration:.0f} s")
                rounds[server].append(serve_round(server, bin_dir, ggufs["bundled"], prompts, args))
        med = {s: max(v, key=lambda x: x["tokens_per_s"]) if len(v) < 3 else sorted(v, key=lambda x: x["tokens_per_s"])[1]
               for s, v in rounds.items()}
        report["http"] = {**{s: _rounded(m) for s, m in med.items()},
                          **{f"{k}{s[len('edgecore'):]}": round(med[s][field] / med["llama.cpp"][field], 3)
                             for s in servers if s != "llama.cpp"
                             for k, field in (("tokens_per_s_ratio", "tokens_per_s"), ("peak_rss_ratio", "peak_rss_mb"))}}
    if "bundled" in report:
        one = report["bundled"]["decode"][1]
        compiled = "ratio_compiled" in one
        emit("peer_llamacpp", "batch1_decode_ratio_bundled" + ("_compiled" if compiled else ""),
             one["ratio_compiled" if compiled else "ratio"], **report)
    else:
        emit("peer_llamacpp", "http_tokens_per_s_ratio", report["http"]["tokens_per_s_ratio"], **report)


if __name__ == "__main__":
    main()
