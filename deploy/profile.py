"""`edgecore profile`: this machine's cost model for one model, measured with the real engine, as a JSON file.

Life cycle: `measure(model_dir, ...)` loads the model into an `LLMEngine` (shared/engine) and times, on this
machine: prefills of several prompt lengths, with and without a cached prefix; pure decode steps over a grid
of batch sizes and contexts; each KV codec's encode and decode speed and ratio on the KV of real prompts
(protocol/codecs); and the engine's KV bytes per token. It fits a `CostModel` (a step's time as a linear
function of its rows, context and prefill tokens, with non-negative coefficients, fitted to relative error)
and returns a `Profile`, which `save` writes and `load_profile` reads back (checked: its format; a different
model fingerprint or edgecore version is a warning naming the difference, via `compare`). The simulator
(deploy/simulator.py) uses only the fitted model, the codec table and the KV sizes.

torch and the engine are imported only by `measure`: reading a profile (plan) needs numpy at most.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgecore.shared.errors import ConfigError

FORMAT = "edgecore-profile/1"


class ProfileError(ConfigError):
    pass


@dataclass(frozen=True)
class CostModel:
    """Seconds of one engine step: base + per_row·rows + per_context·Σ decode contexts + per_prefill_token·n
    + per_attention·n·(cached + n/2) for n prefill tokens after `cached` ones (chunked prefill shares the step)."""
    base_s: float
    per_row_s: float
    per_context_s: float
    per_prefill_token_s: float
    per_attention_s: float

    def step(self, rows: int, context_sum: float, prefill_tokens: float = 0.0, prefill_start: float = 0.0) -> float:
        return (self.base_s + self.per_row_s * rows + self.per_context_s * context_sum
                + prefill_tokens * (self.per_prefill_token_s + self.per_attention_s * (prefill_start
                                                                                        + prefill_tokens / 2)))

    def prefill(self, tokens: int, cached: int = 0, budget: int = 2048) -> float:
        """A lone prefill of `tokens` after `cached`, in chunks of `budget` tokens."""
        total, done = 0.0, 0
        while done < tokens:
            n = min(budget, tokens - done)
            total += self.step(0, 0.0, n, cached + done)
            done += n
        return total


@dataclass(frozen=True)
class CodecSpeed:
    ratio: float            # encoded / bf16 bytes
    encode_bps: float       # bf16 bytes per second of one thread
    decode_bps: float


@dataclass(frozen=True)
class Profile:
    cost: CostModel
    codecs: dict[str, CodecSpeed]
    kv_wire_bytes_per_token: int         # bf16 K/V of every layer (what a codec's ratio applies to)
    kv_memory_bytes_per_token: int       # in the engine's pool at its dtype
    layers: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    kv_capacity_tokens: int = 32768
    model: dict[str, Any] = field(default_factory=dict)      # path, fingerprint
    machine: dict[str, Any] = field(default_factory=dict)
    edgecore_version: str = ""
    measurements: dict[str, Any] = field(default_factory=dict)   # the raw timings the fit came from
    format: str = FORMAT
    # the serving path beyond the engine (deploy/serving_probe.py, `--serving`; 0: not measured): seconds before
    # a request's first token, and per later token
    serving_ttft_s: float = 0.0
    serving_tpot_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def save(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n")


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"profile {path} cannot be read: {exc}") from None
    except ValueError as exc:
        raise ProfileError(f"profile {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"profile {path} is not an {FORMAT} file (made by `edgecore profile`)")
    try:
        cost = CostModel(**{k: float(v) for k, v in data["cost"].items()})
        codecs = {name: CodecSpeed(float(c["ratio"]), float(c["encode_bps"]), float(c["decode_bps"]))
                  for name, c in data["codecs"].items()}
        return Profile(cost, codecs, int(data["kv_wire_bytes_per_token"]), int(data["kv_memory_bytes_per_token"]),
                       int(data["layers"]), int(data["max_num_batched_tokens"]), int(data["max_num_seqs"]),
                       int(data["kv_capacity_tokens"]), model=dict(data.get("model", {})),
                       machine=dict(data.get("machine", {})), edgecore_version=str(data.get("edgecore_version")),
                       measurements=dict(data.get("measurements", {})),
                       serving_ttft_s=float(data.get("serving_ttft_s", 0.0)),
                       serving_tpot_s=float(data.get("serving_tpot_s", 0.0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"profile {path}: missing or bad field ({exc!r})") from None


def edgecore_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("edgecore")
    except PackageNotFoundError:
        return "unknown"


def compare(profile: Profile, model_dir: str | None) -> list[str]:
    """Warnings for a profile made for another model (by fingerprint) or by another edgecore version."""
    warnings = []
    if profile.edgecore_version != edgecore_version():
        warnings.append(f"profile made by edgecore {profile.edgecore_version}, this is {edgecore_version()}")
    if model_dir is not None and profile.model.get("fingerprint"):
        try:
            from edgecore.shared.models.fingerprint import model_fingerprint
            ours = model_fingerprint(model_dir)
        except Exception as exc:     # noqa: BLE001 - a model we cannot read: say so, do not fail the plan
            return [*warnings, f"cannot fingerprint the topology's model {model_dir}: {exc}"]
        if ours != profile.model["fingerprint"]:
            warnings.append(f"profile is for model {profile.model.get('path')} (fingerprint "
                            f"{str(profile.model['fingerprint'])[:12]}), the topology's model {model_dir} is "
                            f"{ours[:12]}")
    return warnings


# ---- fitting ---------------------------------------------------------------------------------------------

def fit(rows: list[tuple[list[float], float]]) -> list[float]:
    """Non-negative least squares on relative error (each row divided by its time), by active set: a
    coefficient that comes out negative is fixed at 0 and the rest refitted."""
    import numpy as np
    x = np.array([r for r, _ in rows], dtype=float)
    y = np.array([t for _, t in rows], dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


def fit_cost(prefills: list[dict[str, float]], decodes: list[dict[str, float]], budget: int) -> CostModel:
    rows: list[tuple[list[float], float]] = []
    for p in prefills:                # steps, tokens, tokens × mean attended context
        n, cached = int(p["tokens"]), int(p["cached"])
        steps = -(-n // budget)
        pairs = 0.0
        for s in range(steps):
            k = min(budget, n - s * budget)
            pairs += k * (cached + s * budget + k / 2)
        rows.append(([steps, 0, 0, n, pairs], p["seconds"]))
    for d in decodes:
        rows.append(([1, d["batch"], d["batch"] * d["context"], 0, 0], d["seconds"]))
    return CostModel(*fit(rows))


# ---- measuring -------------------------------------------------------------------------------------------

def _machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
                            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                            "device": device}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def measure(model_dir: str, device: str = "cpu", dtype: str = "auto", codecs: list[str] | None = None,
            repeats: int = 3, quick: bool = False, log: Any = None) -> Profile:
    """Time the engine on this machine (`quick`: fewer points, for tests)."""
    import torch

    from edgecore.protocol.codecs import CODECS, get_codec
    from edgecore.shared.models.config import CacheConfig, EngineConfig
    from edgecore.shared.engine.engine import LLMEngine
    from edgecore.shared.engine.sampling_params import SamplingParams
    from edgecore.shared.models.fingerprint import model_fingerprint
    say = log or (lambda _msg: None)
    codec_names = codecs or list(CODECS)
    for name in codec_names:
        get_codec(name)                  # unknown names: a one-line error before anything runs
    cache = CacheConfig(num_blocks=4096)
    engine_config = EngineConfig()
    engine = LLMEngine.from_dir(model_dir, dtype, device, cache, engine_config)
    cfg = engine.config
    limit = engine.max_model_len
    vocab = cfg.vocab_size
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    counter = iter(range(1 << 30))

    def prompt(n: int, salt: int) -> list[int]:
        return [(salt * 7919 + i * 31) % (vocab - 2) + 2 for i in range(n)]

    def prefill(ids: list[int]) -> tuple[float, str]:
        rid = f"p{next(counter)}"
        sync()
        t = time.perf_counter()
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
        while engine.has_unfinished():
            engine.step()
        sync()
        return time.perf_counter() - t, rid

    prefill(prompt(64, 0))              # warm-up: first-call costs out of the timings
    engine.release("p0")
    lengths = [n for n in ((16, 128, 512) if quick else (16, 64, 256, 512, 1024, 2048, 4096)) if n < limit]
    prefills: list[dict[str, float]] = []
    for n in lengths:
        times = []
        for r in range(repeats + 1):     # the first is a warm-up (this length's first-call costs)
            seconds, rid = prefill(prompt(n, 1000 + n * 10 + r))
            times.append(seconds)
            engine.release(rid)
        prefills.append({"tokens": n, "cached": 0, "seconds": min(times[1:])})     # min: a shared machine's noise
        say(f"prefill {n} tokens: {prefills[-1]['seconds'] * 1e3:.2f} ms")
    # a cached prefix: the same first half again (whole blocks), then a new second half
    for n in lengths[-2:]:
        times, cached = [], 0
        for r in range(repeats):
            base = prompt(n, 5000 + n + r)
            _, rid = prefill(base)
            engine.release(rid)          # its full blocks stay in the prefix cache
            ids = base[: n // 2] + prompt(n - n // 2, 9000 + n + r)
            cached = engine.cached_prefix(ids)
            seconds, rid = prefill(ids)
            engine.release(rid)
            times.append(seconds)
        prefills.append({"tokens": n - cached, "cached": cached, "seconds": min(times)})
        say(f"prefill {n - cached} tokens after {cached} cached: {prefills[-1]['seconds'] * 1e3:.2f} ms")
    decodes: list[dict[str, float]] = []
    batches = (1, 8, 32) if quick else (1, 4, 16, 64)
    contexts = [c for c in ((32, 256) if quick else (32, 256, 768)) if c + 40 < limit]
    steps = 8 if quick else 16
    for batch in batches:
        for ctx in contexts:
            rids = [f"d{next(counter)}" for _ in range(batch)]
            for i, rid in enumerate(rids):
                engine.add_request(rid, prompt(ctx, 20000 + i + batch * 100 + ctx),
                                   SamplingParams(max_tokens=steps * repeats + 8, temperature=0, ignore_eos=True))
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in (engine.get(r) for r in rids) if s):
                engine.step()
            engine.step()                # first pure decode step (warm)
            times = []
            for _ in range(steps * repeats):
                sync()
                t = time.perf_counter()
                engine.step()
                sync()
                times.append(time.perf_counter() - t)
            for rid in rids:
                engine.abort(rid)
            decodes.append({"batch": batch, "context": ctx + 1 + steps * repeats // 2,
                            "seconds": statistics.median(times)})
            say(f"decode batch {batch}, context {ctx}: {decodes[-1]['seconds'] * 1e3:.3f} ms/step")
    codec_table = _codecs(engine, codec_names, prompt(min(512, limit - 8), 777), 2 if quick else repeats)
    for name, c in codec_table.items():
        say(f"codec {name}: ratio {c.ratio:.3f}, encode {c.encode_bps / 1e6:.0f} MB/s, "
            f"decode {c.decode_bps / 1e6:.0f} MB/s")
    cost = fit_cost(prefills, decodes, engine_config.max_num_batched_tokens)
    return Profile(cost, codec_table, cfg.kv_bytes_per_token(2), engine.kv_bytes_per_token, cfg.num_hidden_layers,
                   engine_config.max_num_batched_tokens, engine_config.max_num_seqs,
                   cache.num_blocks * cache.block_size,
                   model={"path": str(model_dir), "fingerprint": model_fingerprint(model_dir, cfg),
                          "dtype": str(engine.dtype).removeprefix("torch."), "weights_bytes": engine.weights_bytes},
                   machine=_machine(device), edgecore_version=edgecore_version(),
                   measurements={"prefill": prefills, "decode": decodes})


def _codecs(engine: Any, names: list[str], ids: list[int], repeats: int) -> dict[str, CodecSpeed]:
    """Each codec on one prompt's KV (every layer's K and V planes, bf16 as a core sends them)."""
    import numpy as np
    import torch

    from edgecore.protocol.codecs import PlaneInfo, get_codec
    from edgecore.shared.engine.sampling_params import SamplingParams
    from edgecore.shared.kv.wire import codec_rope
    engine.add_request("codec-kv", ids, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    rope = codec_rope(engine.config)
    planes = []
    for layer in range(engine.config.num_hidden_layers):
        k, v = engine.read_kv("codec-kv", layer)
        for kind, t in (("k", k), ("v", v)):
            bits = t.to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().view(np.uint16)[None]
            planes.append((PlaneInfo("bfloat16", bits.shape, kind, 0, len(ids), layer,
                                     rope if kind == "k" else None), bits))
    engine.release("codec-kv")
    raw = sum(bits.nbytes for _, bits in planes)
    out: dict[str, CodecSpeed] = {}
    for name in names:
        codec = get_codec(name)
        enc, dec, size = float("inf"), float("inf"), 0
        for _ in range(repeats):
            e = d = 0.0
            size = 0
            for info, bits in planes:
                t = time.thread_time()
                data = bytes(codec.encode(bits, info))
                e += time.thread_time() - t
                t = time.thread_time()
                codec.decode(data, info)
                d += time.thread_time() - t
                size += len(data)
            enc, dec = min(enc, e), min(dec, d)
        out[name] = CodecSpeed(size / raw, raw / max(enc, 1e-7), raw / max(dec, 1e-7))
    return out
