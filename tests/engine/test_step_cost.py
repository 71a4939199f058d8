"""A step costs what its rows cost, not what the pools hold.

The README's generate example (the tiny model, MTP at draft 3, 8 slots) is run at two pool sizes,
``max_seq_len`` 1024 and 131072 (4096 pages a slot, 32768 in all). A dispatch mode counts the bytes
every aten op writes (its outputs' sizes) during each step. A step that copies or fills a whole plane
(a KV pool, the index plane, the position plane) writes bytes in proportion to the pool, 128x more at
the larger size; a step that writes its rows writes the same bytes at both sizes. What may grow with
the pool is only the per-step host bookkeeping that no op counts (the free list, the block table).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from impl.model.admission import Request
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig, SpeculativeConfig

PROMPT = tuple(b"hello")


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class BytesWritten(TorchDispatchMode):
    """Sums the bytes every aten op writes. An out-of-place op writes its outputs. An in-place op
    returns the tensor it wrote into, so its writes are counted from its arguments: a scatter
    (``index_put_``, ``copy_``, ...) writes as many bytes as the values it is given, ``index_fill_``
    the indexed slices, and a whole-tensor fill (``fill_``, ``zero_``) the whole tensor."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.largest: tuple[int, str] = (0, "")
        self.by_op: dict[str, int] = {}

    def _written(self, func, args, kwargs, out) -> int:
        returns = func._schema.returns
        alias = returns[0].alias_info if returns else None
        if alias is not None and not alias.is_write:  # a view writes nothing
            return 0
        if alias is None:
            return sum(_nbytes(t) for t in tree_leaves(out))
        name = func._schema.name.split("::")[-1]
        target = args[0]
        if name in ("fill_", "zero_", "normal_", "uniform_"):
            return _nbytes(target)
        if name == "index_fill_":
            dim, index = args[1], args[2]
            return index.numel() * (target.numel() // max(target.shape[dim], 1)) \
                * target.element_size()
        return sum(_nbytes(t) for t in tree_leaves((args[1:], kwargs))
                   if isinstance(t, torch.Tensor) and t.dtype not in (torch.int64, torch.bool)
                   or name == "copy_")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        n = self._written(func, args, kwargs, out)
        self.total += n
        self.by_op[str(func)] = self.by_op.get(str(func), 0) + n
        self.largest = max(self.largest, (n, str(func)))
        return out


def _step_bytes(weights, max_seq_len: int, steps: int) -> list[tuple[int, tuple[int, str]]]:
    config = EngineConfig(model="tiny", max_seq_len=max_seq_len,
                          speculative=SpeculativeConfig(draft_length=3))
    engine = Engine(config, weights)
    engine.submit(Request(request_id="r0", prompt=PROMPT, max_new_tokens=4 * steps))
    counts = []
    for _ in range(steps):
        with BytesWritten() as mode:
            engine.step()
        counts.append((mode.total, mode.largest))
    return counts


def test_step_bytes_do_not_grow_with_the_pool(weights):
    # Once-per-process tables (e.g. the torch PLE variant's hash constants a device) are made by a
    # first engine's first step: warm them, so that both sizes count the steps alone.
    _step_bytes(weights, 1024, 1)
    small = _step_bytes(weights, 1024, 4)
    large = _step_bytes(weights, 131072, 4)
    for i, ((s, s_big), (l, l_big)) in enumerate(zip(small, large)):
        # The same rows and the same selections: the same bytes, to the byte.
        assert l == s, (f"step {i}: {l} bytes written at max_seq_len 131072 against {s} at 1024; "
                        f"the largest write was {l_big[0]} bytes by {l_big[1]} (against "
                        f"{s_big[0]} by {s_big[1]})")
    # The steps do write: a context step and verify steps with their commits.
    assert all(s > 0 for s, _ in small)


def test_a_whole_plane_copy_is_counted(weights, monkeypatch):
    """The measure sees the pattern it guards against: an index store that copies the whole index
    plane every step (the functional spec form) writes bytes in proportion to the pool."""
    from impl.model.ops import Ops
    from spec.ops import qsa as spec_qsa

    def copying_store(self, planes, block_table, seq_ids, positions, k_index, *, axes):
        self.d.choose("qsa_index_store", **axes)
        new = spec_qsa.qsa_index_store(planes.index_plane, planes.block_keys,
                                       planes.block_key_valid, block_table, seq_ids, positions,
                                       k_index)
        for old, fresh in zip((planes.index_plane, planes.block_keys, planes.block_key_valid), new):
            old.copy_(fresh)
    monkeypatch.setattr(Ops, "qsa_index_store", copying_store)
    small = _step_bytes(weights, 1024, 1)[0][0]
    large = _step_bytes(weights, 131072, 1)[0][0]
    assert large > 2 * small, (small, large)
