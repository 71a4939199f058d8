"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch

from spec.config import ModelConfig
from spec.model import Weights, init_weights


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Two shared CI cores: one intra-op thread is faster than two for the tiny model's small ops."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def weights() -> Weights:
    """The tiny model with seeded random bf16 weights (the deployment dtype)."""
    return init_weights(ModelConfig.tiny(), seed=0, dtype=torch.bfloat16)
