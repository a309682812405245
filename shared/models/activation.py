"""MLP and expert activations by transformers' `hidden_act` names (config.py's `HiddenAct` lists them).

Each is the formula transformers' ACT2FN applies under that name, on the gate projection before it
multiplies the up projection.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_tanh_python(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation spelled out as transformers does (gelu_new, gelu_python_tanh, gelu_accurate)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_10(x: torch.Tensor) -> torch.Tensor:
    return torch.clip(F.gelu(x), -10.0, 10.0)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]]
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_python": _gelu_erf,
               "gelu_pytorch_tanh": _gelu_tanh, "gelu_python_tanh": _gelu_tanh_python, "gelu_new": _gelu_tanh_python,
               "gelu_accurate": _gelu_tanh_python, "gelu_fast": _gelu_fast, "gelu_10": _gelu_10,
               "quick_gelu": _quick_gelu, "relu": F.relu, "relu2": _relu2, "relu6": F.relu6,
               "leaky_relu": F.leaky_relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "mish": F.mish,
               "hardswish": F.hardswish, "linear": lambda x: x}
