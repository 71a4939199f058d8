"""The page pool's bookkeeping (impl/model/cache.py ``PagePool``): a slot holds a prefix of its
table row; a step's ``ensure`` costs the pages it takes, not the pages the slot holds (a decode step
of 128 requests at 8192 tokens used to read 256 table entries a request on the host); running out
of pages takes none."""

from __future__ import annotations

import pytest
import torch

from impl.model.cache import PAGE, OutOfPages, PagePool


class _Untouchable:
    """A block table that fails on any access: ``ensure`` of pages a slot holds must not read it."""

    def __getitem__(self, key):
        raise AssertionError(f"the block table was read at {key}")

    def __setitem__(self, key, value):
        raise AssertionError(f"the block table was written at {key}")


def test_a_slot_holds_a_prefix_and_ensure_takes_only_new_pages():
    pool = PagePool(num_pages=64, slots=2, pages_per_slot=32)
    assert pool.ensure(0, 3 * PAGE + 1) == [63, 62, 61, 60]
    assert pool.ensure(1, 1) == [59]
    assert pool.ensure(0, 5 * PAGE) == [58]
    assert pool.pages_of(0) == [63, 62, 61, 60, 58]
    assert pool.block_table[0, :6].tolist() == [63, 62, 61, 60, 58, -1]
    assert pool.release(0) == [63, 62, 61, 60, 58]
    assert pool.block_table[0].tolist() == [-1] * 32 and pool.held[0] == 0
    assert pool.ensure(0, PAGE) == [63]            # released pages come back in order


def test_ensure_of_held_pages_reads_nothing():
    pool = PagePool(num_pages=8192, slots=1, pages_per_slot=8192)
    pool.ensure(0, 8192 * PAGE)
    pool.block_table = _Untouchable()
    for length in (1, 4096 * PAGE, 8192 * PAGE):
        assert pool.ensure(0, length) == []


def test_out_of_pages_takes_none():
    pool = PagePool(num_pages=3, slots=2, pages_per_slot=8)
    pool.ensure(0, 2 * PAGE)
    with pytest.raises(OutOfPages, match="no free page"):
        pool.ensure(1, 3 * PAGE)
    assert pool.free == [0] and pool.held[1] == 0
    assert torch.equal(pool.block_table[1], torch.full((8,), -1, dtype=torch.int32))
    with pytest.raises(OutOfPages, match="more than"):
        pool.ensure(1, 9 * PAGE)


class _Recording:
    """A block table that records how many entries each write covers."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.written: list[int] = []

    def __getitem__(self, key):
        return self.table[key]

    def __setitem__(self, key, value):
        self.written.append(self.table[key].numel())
        self.table[key] = value


def test_release_writes_only_the_entries_the_slot_held():
    """Releasing a slot costs its pages, not its row (8192 entries here): a request that leaves,
    finished or handed to a peer engine, resets only the table entries it held."""
    pool = PagePool(num_pages=8192, slots=2, pages_per_slot=8192)
    pool.ensure(0, 3 * PAGE)
    pool.ensure(1, PAGE)
    pool.block_table = recording = _Recording(pool.block_table)
    assert pool.release(0) == [8191, 8190, 8189]
    assert recording.written == [3]
    assert recording.table[0].tolist() == [-1] * 8192
    assert recording.table[1, :2].tolist() == [8188, -1]
