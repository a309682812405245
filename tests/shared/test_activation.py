"""Every `hidden_act` the config accepts computes what transformers' ACT2FN computes under that name."""

import typing

import pytest
import torch

from edgecore.shared.models.config import HiddenAct
from edgecore.shared.models.activation import ACTIVATIONS

transformers_activations = pytest.importorskip("transformers.activations")


def test_accepted_names_are_the_implemented_ones_and_match_transformers():
    names = typing.get_args(HiddenAct)
    assert set(names) == set(ACTIVATIONS)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 6
    for name in names:
        torch.testing.assert_close(ACTIVATIONS[name](x), transformers_activations.ACT2FN[name](x), rtol=0, atol=1e-6,
                                   msg=name)
