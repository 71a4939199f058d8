"""Metamorphic checks of the engine in batch-invariant mode: a request's tokens depend neither on the
order the requests arrive in, nor on the other requests sharing its steps, nor on the batch size.

In batch-invariant mode every op's row result is independent of the launch it shares, so the
slots, pages, chunk boundaries and step kinds a request meets change and its greedy tokens must
not. These relations need no reference run: they check the engine's own bookkeeping (slot reuse,
state resets, block tables, the token budget's chunking), and a planted stale-state bug breaks
them."""

from __future__ import annotations

import pytest

from impl.model import engine as engine_mod
from tests.engine.test_engine import LENGTHS, _engine, _requests


def _tokens(weights, requests, **kw) -> dict[str, list[int]]:
    report = _engine(weights, **kw).generate(requests)
    return {rid: list(r.tokens) for rid, r in report.results.items()}


@pytest.mark.parametrize("kv,k", [("bf16", None), ("nvfp4", 3)])
def test_permuting_requests_permutes_their_tokens(weights, kv, k):
    requests = _requests(LENGTHS)
    base = _tokens(weights, requests, kv=kv, k=k)
    assert all(len(t) == 6 for t in base.values()), base
    for order in ([2, 1, 0], [1, 2, 0]):
        assert _tokens(weights, [requests[i] for i in order], kv=kv, k=k) == base, order


def test_a_request_alone_gets_the_tokens_it_gets_in_a_batch(weights):
    requests = _requests(LENGTHS)
    base = _tokens(weights, requests, batch=2)   # two slots: the third request reuses one
    for r in requests:
        assert _tokens(weights, [r], batch=1) == {r.request_id: base[r.request_id]}, r.request_id


def test_a_slot_that_keeps_stale_state_breaks_the_relation(weights, monkeypatch):
    """Planted bug: a released slot keeps its GDN state, so whichever request reuses it starts from
    its predecessor's state; which request that is depends on the arrival order."""
    monkeypatch.setattr(engine_mod.GDNPool, "reset", lambda self, slot: None)
    requests = _requests(LENGTHS)
    base = _tokens(weights, requests, batch=2)
    moved = _tokens(weights, [requests[i] for i in (2, 1, 0)], batch=2)
    assert moved != base


def test_in_its_default_dispatch_permuting_requests_permutes_their_tokens(weights):
    """Without batch-invariant mode the engine runs the variants its dispatch rules choose, torch
    compositions among them, one of which (ple_embed's torch GEMM) rounds a row otherwise in a
    launch of another size. Permuting the requests permutes the rows of each launch without
    changing its size, so a request's tokens must still not depend on its place in the batch."""
    e = _engine(weights, invariant=False)
    requests = _requests(LENGTHS)
    base = {rid: list(r.tokens) for rid, r in e.generate(requests).results.items()}
    catalog = e.dispatcher.catalog
    assert any(catalog.ops[op].variant(v).impl != "spec" for op, v in e.dispatcher.ran)
    for order in ([2, 1, 0], [1, 2, 0]):
        assert _tokens(weights, [requests[i] for i in order], invariant=False) == base, order
