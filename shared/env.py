"""Every environment variable edgecore reads, in one place.

EDGECORE_MODEL      default model directory (else the bundled models/pydoc-llama)
EDGECORE_DEVICE     default device (else cuda when available, otherwise cpu)
EDGECORE_THREADS    torch intra-op threads (else torch's default)
EDGECORE_SECRET     cluster secret (else --secret-file)
EDGECORE_API_KEYS   comma-separated API keys for the edge (else --api-key-file)
EDGECORE_LOG_LEVEL  logging level (INFO)
EDGECORE_CPU_PACK   0 keeps plain linear weights on CPU (else they are packed for oneDNN)
"""

from __future__ import annotations

import os
from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "models" / "pydoc-llama"


def default_model() -> str:
    return os.environ.get("EDGECORE_MODEL") or str(BUNDLED_MODEL)


def default_device() -> str:
    env = os.environ.get("EDGECORE_DEVICE")
    if env:
        return env
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_threads() -> None:
    value = os.environ.get("EDGECORE_THREADS")
    if value:
        import torch
        torch.set_num_threads(int(value))


def cpu_pack_enabled() -> bool:
    return os.environ.get("EDGECORE_CPU_PACK", "1") != "0"
