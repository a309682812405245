"""Every environment variable edgecore reads, in one place.

EDGECORE_MODEL      default model directory (else the bundled pydoc-llama, package data of edgecore.models)
EDGECORE_DEVICE     default device (else cuda when available, otherwise cpu)
EDGECORE_THREADS    torch intra-op threads (else torch's default)
EDGECORE_SECRET     cluster secret (else --secret-file)
EDGECORE_API_KEYS   comma-separated API keys for the edge (else --api-key-file)
EDGECORE_LOG_LEVEL  logging level (INFO)
EDGECORE_CPU_PACK   0 keeps plain linear weights on CPU (else they are packed for oneDNN)
EDGECORE_SMALL_STEP_THREADS  one / all: threads of a small model's steps under 16 tokens (else timed, see
                    shared/engine/step_threads.py)
EDGECORE_PACKED_FROM_ROWS  rows from which a small packed weight's oneDNN layout is used (else timed at
                    start-up, see shared/models/layers.py)
EDGECORE_CPU_MALLOC 0 keeps glibc's default heap thresholds (else see shared/node/malloc.py)
EDGECORE_LINK_SEALED 0: the core-edge link's frames are authenticated but NOT encrypted (anyone on the wire reads
                    prompts, tokens and KV) — only to measure what encryption costs (bench/link_ttft.py)
EDGECORE_KV_PACING  how a core writes KV on a version-3 link: paced (default: buffers bounded, frames cut and
                    paced at the rate the edge reports receiving, core/pacer.py), bounded (not paced) or off
                    (only the kernel's backlog bounded) — for measurement, core/prefill_service.py
OPENBLAS_NUM_THREADS numpy's BLAS threads (read by OpenBLAS; the `edgecore` command sets 1 unless given, see
                    deploy/cli.py: the KV codecs' column sums run beside torch's threads)
"""

from __future__ import annotations

import os

from edgecore.models import bundled_model_dir

BUNDLED_MODEL = bundled_model_dir()


def default_model() -> str:
    return os.environ.get("EDGECORE_MODEL") or str(BUNDLED_MODEL)


def default_device() -> str:
    env = os.environ.get("EDGECORE_DEVICE")
    if env:
        return env
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | None) -> str:
    """`--device` (or the default), checked: a device this torch build cannot use is a ConfigError."""
    import torch

    from edgecore.shared.errors import ConfigError
    device = requested or default_device()
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ConfigError(f"unknown device '{device}' (e.g. cpu, cuda, cuda:1)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device '{device}' is not available: this torch build or machine has no CUDA GPU "
                          "(use --device cpu)")
    return device


def apply_threads() -> None:
    """EDGECORE_THREADS as torch's intra-op thread count, without importing torch: a process that never
    needs it (the edge's HTTP frontend) must not pay its memory. Before torch is imported, OMP_NUM_THREADS
    is what torch reads its count from."""
    value = os.environ.get("EDGECORE_THREADS")
    if value:
        import sys
        threads = str(max(1, int(value)))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        else:
            os.environ["OMP_NUM_THREADS"] = threads


def reserve_threads_for_engine() -> int:
    """In a server (an engine thread beside the event loop), call before any torch work: returns the intra-op
    thread count for the engine thread (EDGECORE_THREADS, else torch's default) and leaves this thread one.

    With GNU OpenMP, every thread that runs a parallel op leads a team of its own; once the process has more
    OpenMP threads than CPUs (the main thread's team plus the engine thread's), the workers stop spinning
    between parallel regions and each small op pays a wake-up: an engine stepped 20-35% slower. So only the
    engine thread may lead a team; this (main) thread loads the model with one thread."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def small_step_threads() -> str | None:
    value = os.environ.get("EDGECORE_SMALL_STEP_THREADS")
    if not value:
        return None
    if value not in ("one", "all"):
        from edgecore.shared.errors import ConfigError
        raise ConfigError(f"EDGECORE_SMALL_STEP_THREADS must be 'one' or 'all', got {value!r}")
    return value


def packed_from_rows() -> int | None:
    value = os.environ.get("EDGECORE_PACKED_FROM_ROWS")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        from edgecore.shared.errors import ConfigError
        raise ConfigError(f"EDGECORE_PACKED_FROM_ROWS must be a positive integer, got {value!r}")
    return int(value)


def cpu_pack_enabled() -> bool:
    return os.environ.get("EDGECORE_CPU_PACK", "1") != "0"


def cpu_malloc_tuning_enabled() -> bool:
    return os.environ.get("EDGECORE_CPU_MALLOC", "1") != "0"


def link_sealed() -> bool:
    return os.environ.get("EDGECORE_LINK_SEALED", "1") != "0"


def kv_pacing_mode() -> str:
    return os.environ.get("EDGECORE_KV_PACING", "paced")
