"""impl.train.diagnose reads the selection on the answer rows at the record's block: with every block
selectable it holds on every row, with the index selection off on none (the record lies far outside
the sink and local window), and the target-peak column covers exactly the answer rows."""

from __future__ import annotations

import random

import torch

from impl.tasks.retrieval import Retrieval, RetrievalParams
from impl.train.diagnose import diagnose
from impl.train.model import TrainModel
from spec.config import ModelConfig


def _far_sample():
    task = Retrieval()
    for i in range(50):
        s = task.generate(random.Random(i), RetrievalParams(length=512), 1)
        if 2 <= s.meta["block"] <= 10:
            return s
    raise AssertionError("no sample with its record away from the sink and the query")


def test_selection_column_follows_top_k():
    torch.manual_seed(0)
    sample = _far_sample()
    model = TrainModel(ModelConfig.tiny(), seed=5)
    model.eval()
    rows = len(sample.answer_ids())
    model.cfg = model.cfg.model_copy(update={"top_k_blocks": 64})
    every = diagnose(model, sample)
    assert every.block == sample.meta["block"]
    assert all(len(s) == rows and all(s) for s in every.selected)
    assert len(every.target_peak) == rows
    model.cfg = model.cfg.model_copy(update={"top_k_blocks": 0})
    none = diagnose(model, sample)
    assert all(not any(s) for s in none.selected)
    assert not none.correct  # an untrained model does not recall a 10-digit value


def test_dense_block_mass_of_a_row_slice_is_that_slice_of_the_whole():
    """diagnose reads the answer rows only (``first``): the same numbers as the full T x T pass."""
    from impl.train.model import BLOCK, dense_block_mass
    torch.manual_seed(1)
    T, nb = 300, -(-300 // BLOCK)
    q, k = torch.randn(1, T, 4, 16), torch.randn(1, T, 2, 16)
    whole = dense_block_mass(q, k, nb, chunk=128)
    part = dense_block_mass(q[:, 200:211], k, nb, chunk=4, first=200)
    torch.testing.assert_close(part, whole[:, 200:211], rtol=0, atol=1e-6)
    assert not torch.allclose(dense_block_mass(q[:, 200:211], k, nb), whole[:, 200:211])  # first=0
