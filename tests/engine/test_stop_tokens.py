"""Stop tokens (``Request.stop_token_ids``): a request's output ends at the first stop token it
emits, kept; the other requests of its steps are not affected; a bad stop id is rejected alone."""

from __future__ import annotations

import pytest

from tests.engine.test_engine import LENGTHS, _engine, _requests


@pytest.mark.parametrize("k", [None, 3])
def test_a_request_stops_at_its_first_stop_token(weights, k):
    requests = _requests(LENGTHS, new=8)
    base = {rid: r.tokens for rid, r in _engine(weights, k=k).generate(requests).results.items()}
    first = requests[0]
    stop = base[first.request_id][3]
    cut = base[first.request_id].index(stop) + 1
    stopping = first.model_copy(update={"stop_token_ids": (stop,)})
    got = _engine(weights, k=k).generate([stopping, *requests[1:]]).results
    assert got[first.request_id].tokens == base[first.request_id][:cut]
    for r in requests[1:]:
        assert got[r.request_id].tokens == base[r.request_id], r.request_id


def test_a_stop_id_outside_the_vocabulary_is_rejected_alone(weights):
    requests = _requests(LENGTHS[:2], new=3)
    bad = requests[0].model_copy(update={"stop_token_ids": (3, 256)})
    res = _engine(weights).generate([bad, requests[1]]).results
    assert "stop_token_ids: entry 1 is 256, not a token id in 0..255" in res[bad.request_id].error
    assert len(res[requests[1].request_id].tokens) == 3
