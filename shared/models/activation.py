"""The dense MLP's activations by transformers' `hidden_act` names (config.py's `HiddenAct` lists them).

Each is the formula transformers' ACT2FN applies under that name, on the gate projection before it
multiplies the up projection.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, spelled out as it does (the tanh approximation)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh,
               "gelu_new": _gelu_new, "gelu_fast": _gelu_fast, "relu": F.relu, "quick_gelu": _quick_gelu}
