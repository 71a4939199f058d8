"""The n-gram windows and the history by hand: which ids a row's n-grams read, and what the history
holds after a step (docs/spec.md, "PLE with hashed n-grams"). The cells compare variants with the spec,
so a spec that reads its window in the wrong order, or keeps the wrong ids, passes them."""

from __future__ import annotations

import pytest
import torch

from spec.ops.ple import ple_history_advance, ple_ngram_ids


@pytest.mark.certify_property("ple_ngram_hash")
def test_a_decode_rows_window_is_newest_first():
    """Per-row histories [t, 2] hold two ids oldest first: row 0's window is (7, 2, 1)."""
    ids = torch.tensor([7, 8])
    history = torch.tensor([[1, 2], [3, 4]])
    assert ple_ngram_ids(ids, history).tolist() == [[7, 2, 1], [8, 4, 3]]


@pytest.mark.certify_property("ple_ngram_hash")
def test_a_sequences_windows_read_the_history_before_it():
    ids = torch.tensor([5, 6, 7])
    assert ple_ngram_ids(ids, torch.tensor([1, 2])).tolist() == [[5, 2, 1], [6, 5, 2], [7, 6, 5]]


@pytest.mark.certify_property("ple_embed")
def test_the_history_keeps_the_last_two_ids():
    assert ple_history_advance(torch.tensor([1, 2]), torch.tensor([3, 4, 5])).tolist() == [4, 5]
    assert ple_history_advance(torch.tensor([1, 2]), torch.tensor([3])).tolist() == [2, 3]
