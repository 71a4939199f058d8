"""The end-to-end oracle of speculative decoding (docs/spec.md, "Speculative oracle"): greedy
speculative decoding emits exactly the non-speculative greedy tokens whenever the implementation is
batch-invariant.

The draft layer of a random-weight model almost never guesses right, which would leave only the
all-rejected path. So the drafts are replaced (``Engine.propose_hook``) by the true greedy
continuation, taken from a plain run, with a fixed pattern of corrupted positions: verify steps
range from all rejected to all accepted (at K = 7 too: counts 1 to 8 except 7 in the K = 7 runs), and
the tokens must still equal the plain run's. Outside batch-invariant
mode the test reports the first divergent token and its logit margin (top-1 minus top-2 of the plain
run there) and fails only when the margin shows it is not a near-tie.
"""

from __future__ import annotations

import pytest
import torch

from impl.model.admission import Request
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig, SpeculativeConfig
from spec.config import ModelConfig
from tests.engine.spec_replay import token_logits

TINY = ModelConfig.tiny()
NEW = 24
PROMPT_LENS = (29, 7, 45)


def _requests() -> list[Request]:
    gen = torch.Generator().manual_seed(11)
    return [Request(request_id=f"r{i}", prompt=tuple(torch.randint(0, TINY.vocab_size, (n,),
                                                                   generator=gen).tolist()),
                    max_new_tokens=NEW) for i, n in enumerate(PROMPT_LENS)]


def _engine(weights, kv, state, k, invariant) -> Engine:
    spec = SpeculativeConfig(draft_length=k) if k else None
    config = EngineConfig(model="tiny", kv_cache_dtype=kv, state_dtype=state, max_batch_size=3,
                          max_num_tokens=48, max_seq_len=96, batch_invariant=invariant,
                          speculative=spec)
    return Engine(config, weights, log_calls=True)


_PLAIN: dict[tuple, tuple] = {}


def plain_run(weights, kv, state, invariant=True):
    key = (kv, state, invariant)
    if key not in _PLAIN:
        e = _engine(weights, kv, state, 0, invariant)
        _PLAIN[key] = (e.generate(_requests()), e)
    return _PLAIN[key]


def oracle_drafts(plain, reqs):
    """Drafts from the plain run's tokens, corrupted at a fixed pseudo-random sixth of the positions
    (runs of correct drafts up to about 20 long: all-accepted occurs even at K = 7)."""
    prompt_len = {r.request_id: len(r.prompt) for r in reqs}

    def hook(rid: str, first: int, drafts: list[int]) -> list[int]:
        toks = plain.results[rid].tokens
        out = []
        for j in range(len(drafts)):
            pos = first + j
            i = pos - prompt_len[rid]
            true = toks[i] if i < len(toks) else 0
            wrong = (pos * 2654435761 + 97 * int(rid[1:])) % 2 ** 16 % 6 == 0
            out.append((true + 1) % TINY.vocab_size if wrong else true)
        return out
    return hook


@pytest.mark.parametrize("kv,state", [("bf16", "fp32"), ("bf16", "bf16"), ("fp8", "fp32"),
                                      ("fp8", "bf16"), ("nvfp4", "fp32"), ("nvfp4", "bf16")])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_speculative_tokens_equal_greedy(weights, kv, state, k):
    plain, _ = plain_run(weights, kv, state)
    e = _engine(weights, kv, state, k, invariant=True)
    reqs = _requests()
    e.propose_hook = oracle_drafts(plain, reqs)
    spec = e.generate(reqs)
    for r in reqs:
        assert spec.results[r.request_id].tokens == plain.results[r.request_id].tokens, r.request_id
    counts = [n for res in spec.results.values() for n in res.num_accepted]
    assert 1 in counts and k + 1 in counts, counts   # all rejected and all accepted both occur
    assert spec.acceptance_length > 1.0


def first_divergence(plain_tokens: list[int], spec_tokens: list[int], logits: list[torch.Tensor]
                     ) -> tuple[int, float, float] | None:
    """(index, margin top1 - top2 of the plain logits there, the row's largest |logit|) or None."""
    for i, (a, b) in enumerate(zip(plain_tokens, spec_tokens)):
        if a != b:
            top = torch.topk(logits[i].double(), 2).values
            return i, float(top[0] - top[1]), float(logits[i].abs().max())
    return None


@pytest.mark.parametrize("kv,state,k", [("bf16", "fp32", 3), ("fp8", "bf16", 7)])
def test_default_mode_reports_first_divergence(weights, kv, state, k, record_property):
    """Default dispatch (torch GDN variants): speculative and plain runs may round a row differently.
    A divergence is reported with its margin; it is accepted only at a near-tie (a margin within
    four bf16 ulp of the row's largest logit, the size of the logit error the engine's tolerance
    test allows), never silently."""
    plain, plain_engine = plain_run(weights, kv, state, invariant=False)
    e = _engine(weights, kv, state, k, invariant=False)
    reqs = _requests()
    e.propose_hook = oracle_drafts(plain, reqs)
    spec = e.generate(reqs)
    for r in reqs:
        got, want = spec.results[r.request_id].tokens, plain.results[r.request_id].tokens
        div = first_divergence(want, got, token_logits(plain_engine.calls, r))
        record_property(f"{r.request_id}_first_divergence", repr(div))
        if div is not None:
            i, margin, scale = div
            assert margin <= 4 * scale * 2 ** -8, (
                f"{r.request_id}: token {i} differs ({want[i]} plain vs {got[i]} speculative) at a "
                f"logit margin of {margin:.4g}, not a near-tie (row max {scale:.4g})")
