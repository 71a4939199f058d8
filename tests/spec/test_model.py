"""The model-level reference forward (spec/model.py): it runs, its caches are exact, and its decisions.

Equalities between two ways of running the same tokens (prefill + decode, chunked prefill, batch
composition) are checked in float64 to 1e-9 relative: the two ways round differently only where a
BLAS call sees a different number of rows, which moves float64 results by ~1e-15.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.config import ModelConfig
from spec.model import (
    ModelCache,
    Weights,
    forward,
    init_weights,
    mtp_draft,
    mtp_propose,
    new_cache,
    weight_elements,
)
from spec.ops.norms import rmsnorm

F64 = torch.float64
TINY = ModelConfig.tiny()
REL = 1e-9


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Two shared CI cores: one intra-op thread is several times faster than two for these tiny ops."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def w64() -> Weights:
    return init_weights(TINY, seed=0, dtype=F64)


@pytest.fixture(scope="module")
def w32() -> Weights:
    return init_weights(TINY, seed=0, dtype=torch.float32)


def _tokens(seed: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _cache(batch: int, max_len: int = 64, dtype: torch.dtype = F64, **kw) -> ModelCache:
    return new_cache(TINY, batch, max_len, dtype=dtype, **kw)


# ---------------------------------------------------------------- runs


def test_param_count_equals_instantiated_weights(w32: Weights) -> None:
    assert weight_elements(w32) == TINY.param_count()
    target = ModelConfig.target()
    meta = init_weights(target, dtype=torch.bfloat16, device="meta")
    assert weight_elements(meta) == target.param_count()


def test_tiny_forward_runs_on_cpu(w32: Weights) -> None:
    cache = _cache(2, 96, dtype=torch.float32)
    toks = _tokens(1, 2, 64)
    logits = forward(w32, TINY, toks, cache)
    step = forward(w32, TINY, toks[:, :1], cache)
    assert logits.shape == (2, 64, TINY.vocab_size) and logits.dtype == torch.float32
    assert step.shape == (2, 1, TINY.vocab_size)
    assert bool(torch.isfinite(logits).all()) and bool(torch.isfinite(step).all())
    assert cache.lengths == [65, 65]


def test_target_forward_on_meta() -> None:
    cfg = ModelConfig.target()
    w = init_weights(cfg, dtype=torch.bfloat16, device="meta")
    V, C = cfg.vocab_size, cfg.hidden
    # nvfp4 KV and bf16 state: the shape-only storage branch (the plain-cast KV path is the tiny
    # tests'; every target forward costs ~2 s of meta dispatch).
    cache = new_cache(cfg, 2, 96, dtype=torch.bfloat16, device="meta", kv_dtype="nvfp4",
                      state_dtype=torch.bfloat16)
    # a mixed step (a 3-token prefill chunk and a 1-token one), then a decode step
    out, hidden = forward(w, cfg, [torch.arange(3), torch.tensor([7])], cache, return_hidden=True)
    assert [tuple(o.shape) for o in out] == [(3, V), (1, V)]
    assert out[0].device.type == "meta" and out[0].dtype == torch.float32  # logits_cast
    assert [tuple(h.shape) for h in hidden] == [(3, C), (1, C)]
    step = forward(w, cfg, torch.tensor([[5], [6]]), cache)
    assert tuple(step.shape) == (2, 1, V)
    assert cache.lengths == [4, 2]
    draft_logits, draft_hidden = mtp_draft(w, cfg, hidden, [torch.arange(3), torch.tensor([1])],
                                           cache)
    assert [tuple(o.shape) for o in draft_logits] == [(3, V), (1, V)]
    assert [tuple(h.shape) for h in draft_hidden] == [(3, C), (1, C)]
    gdn, qsa = cache.layers[0], cache.layers[3].planes
    assert tuple(gdn.state.shape) == (2, 48, 128, 128) and gdn.state.dtype == torch.bfloat16
    packed, scales = qsa.k_cache                      # 2 sequences x 3 pages of 32 tokens
    assert tuple(packed.shape) == (6, 32, 2, 128) and tuple(scales.shape) == (6, 32, 2, 16)
    drafts, logits = mtp_propose(w, cfg, torch.stack([hidden[0][-1], hidden[1][-1]]),
                                 torch.tensor([1, 2]), cache, num_draft=2)
    assert tuple(drafts.shape) == (2, 2) and tuple(logits.shape) == (2, 2, V)


# ---------------------------------------------------------------- cache exactness


def test_prefill_then_decode_equals_full_forward(w64: Weights) -> None:
    """Prefill 28 tokens, then decode 12 one at a time across the 32-token block boundary (the first
    block key is written at position 31 by a decode step)."""
    toks = _tokens(2, 2, 40)
    full, full_h = forward(w64, TINY, toks, _cache(2), return_hidden=True)
    cache = _cache(2)
    parts, hs = zip(forward(w64, TINY, toks[:, :28], cache, return_hidden=True),
                    *[forward(w64, TINY, toks[:, i:i + 1], cache, return_hidden=True)
                      for i in range(28, 40)])
    inc, inc_h = torch.cat(parts, dim=1), torch.cat(hs, dim=1)
    assert _rel(inc, full) < REL and _rel(inc_h, full_h) < REL
    qsa = cache.layers[3].planes
    assert int(qsa.block_key_valid.sum()) == 2  # block 0 of each sequence is complete, block 1 not


@settings(max_examples=4)
@given(split0=st.integers(1, 39), split1=st.integers(1, 39))
def test_chunked_prefill_equals_one_prefill(w64: Weights, split0: int, split1: int) -> None:
    """Two chunks per sequence, split at drawn points (a ragged step: the sequences' chunks differ in
    length, and a 1-token chunk rides along with a longer one) equal one prefill of the 40 tokens."""
    toks = _tokens(3, 2, 40)
    full = forward(w64, TINY, toks, _cache(2))
    cache = _cache(2)
    first = forward(w64, TINY, [toks[0, :split0], toks[1, :split1]], cache)
    second = forward(w64, TINY, [toks[0, split0:], toks[1, split1:]], cache)
    for s in range(2):
        assert _rel(torch.cat([first[s], second[s]]), full[s]) < REL


@settings(max_examples=3)
@given(others=st.lists(st.integers(1, 40), min_size=1, max_size=2), where=st.integers(0, 2))
def test_batch_composition_does_not_change_logits(w64: Weights, others: list[int], where: int) -> None:
    """A sequence's logits alone equal its logits in a batch with other sequences of other lengths
    (its slot drawn), over a prefill chunk and two decode steps."""
    toks = _tokens(4, 30)
    alone_cache = _cache(1)
    alone = [forward(w64, TINY, [toks[:28]], alone_cache)[0]]
    alone += [forward(w64, TINY, [toks[i:i + 1]], alone_cache)[0] for i in (28, 29)]

    where = min(where, len(others))
    rest = [_tokens(10 + i, n) for i, n in enumerate(others)]
    batch = rest[:where] + [toks[:28]] + rest[where:]
    cache = _cache(len(batch))
    got = [forward(w64, TINY, batch, cache)[where]]
    for i in (28, 29):
        step = [t[:1] for t in rest[:where]] + [toks[i:i + 1]] + [t[:1] for t in rest[where:]]
        got.append(forward(w64, TINY, step, cache)[where])
    for a, b in zip(got, alone):
        assert _rel(a, b) < 1e-12


def test_batch_composition_is_bitwise(w64: Weights) -> None:
    toks = _tokens(1, 3, 40)
    together = forward(w64, TINY, toks, _cache(3))
    alone = forward(w64, TINY, toks[1:2], _cache(1))
    assert torch.equal(together[1], alone[0])


# ---------------------------------------------------------------- QSA at model level


def test_sparse_selection_engages_past_the_window(w32: Weights) -> None:
    """tiny: top-2 blocks + sink 1 + local 2. Rows up to position 159 have at most 2 candidate blocks,
    so they select everything and equal a dense (top-64) model bit for bit; from 160 on, a block is
    dropped and the logits differ."""
    toks = _tokens(6, 1, 176)
    sparse = forward(w32, TINY, toks, _cache(1, 192, torch.float32))
    dense_cfg = ModelConfig(**{**TINY.model_dump(), "top_k_blocks": 64})
    dense = forward(w32, dense_cfg, toks, new_cache(dense_cfg, 1, 192, dtype=torch.float32))
    assert torch.equal(sparse[0, :160], dense[0, :160])
    assert not torch.equal(sparse[0, 160:], dense[0, 160:])


@pytest.mark.parametrize("kv_dtype,state_dtype", [("bf16", torch.bfloat16), ("fp8", torch.float32),
                                                  ("nvfp4", torch.float32)])
def test_storage_formats_run(w32: Weights, kv_dtype: str, state_dtype: torch.dtype) -> None:
    """Quantised KV and bf16 state: prefill + decode run, stay finite, and do round (differ from the
    unrounded cache) while staying near it."""
    toks = _tokens(7, 2, 36)
    exact = forward(w32, TINY, toks, _cache(2, dtype=torch.float32))
    cache = _cache(2, dtype=torch.float32, kv_dtype=kv_dtype, state_dtype=state_dtype)
    got = torch.cat([forward(w32, TINY, toks[:, :33], cache), forward(w32, TINY, toks[:, 33:34], cache),
                     forward(w32, TINY, toks[:, 34:], cache)], dim=1)
    assert bool(torch.isfinite(got).all())
    rel_rms = float((got - exact).norm() / exact.norm())
    assert 0 < rel_rms < 0.5
    assert cache.layers[0].state.dtype == state_dtype


def test_bf16_model_returns_widened_bf16_logits() -> None:
    w = init_weights(TINY, seed=0, dtype=torch.bfloat16)
    logits = forward(w, TINY, _tokens(8, 1, 8),
                     _cache(1, dtype=torch.bfloat16, kv_dtype="bf16", state_dtype=torch.bfloat16))
    assert logits.dtype == torch.float32
    assert torch.equal(logits.to(torch.bfloat16).to(torch.float32), logits)


# ---------------------------------------------------------------- decisions


def test_hidden_is_the_pre_norm_stream_mean(w64: Weights) -> None:
    """``return_hidden`` gives m (the stream mean before the final norm): the logits are its read-out."""
    logits, hidden = forward(w64, TINY, _tokens(9, 1, 5), _cache(1), return_hidden=True)
    readout = rmsnorm(hidden[0], w64.final_norm) @ w64.lm_head.T
    assert _rel(readout, logits[0]) < 1e-12


def _without_mixer_post(w: Weights) -> Weights:
    """The same weights with every mixer site's l_post bias at -1e4, so H_post = 2 sigmoid(.) = 0."""
    n = TINY.hc_streams
    layers = []
    for lw in w.layers:
        bias = lw.hc_mixer.bias.clone()
        bias[n:2 * n] = -1e4
        layers.append(dataclasses.replace(lw, hc_mixer=dataclasses.replace(lw.hc_mixer, bias=bias)))
    return dataclasses.replace(w, layers=layers)


def _scaled_ple(w: Weights, factor: float) -> Weights:
    layers = [dataclasses.replace(lw, ple=dataclasses.replace(lw.ple, w_gate=lw.ple.w_gate * factor))
              for lw in w.layers]
    return dataclasses.replace(w, layers=layers)


def test_ple_sits_inside_the_mixer_site(w64: Weights) -> None:
    """PLE is part of the mixer site's sublayer (y = ple_apply(mixer(u), e_l)), so it reaches the
    streams only through H_post: with the mixer sites' H_post = 0, the PLE weights change nothing."""
    toks = _tokens(11, 1, 6)

    def run(w: Weights) -> torch.Tensor:
        return forward(w, TINY, toks, _cache(1))

    assert not torch.equal(run(w64), run(_scaled_ple(w64, 3.0)))
    gated = _without_mixer_post(w64)
    assert torch.equal(run(gated), run(_scaled_ple(gated, 3.0)))


def test_mtp_draft_cache_and_chaining(w64: Weights) -> None:
    """The draft layer over the prompt's pairs (h_t, x_{t+1}) in one chunk equals two chunks; greedy
    drafting chains the draft layer's own hidden and argmax."""
    toks = _tokens(12, 1, 37)
    cache = _cache(1)
    _, hidden = forward(w64, TINY, toks[:, :36], cache, return_hidden=True)
    one = mtp_draft(w64, TINY, hidden, toks[:, 1:], cache.clone())[0]
    two_cache = cache.clone()
    a = mtp_draft(w64, TINY, hidden[:, :20], toks[:, 1:21], two_cache)[0]
    b = mtp_draft(w64, TINY, hidden[:, 20:], toks[:, 21:], two_cache)[0]
    assert _rel(torch.cat([a, b], dim=1), one) < REL
    assert two_cache.mtp_lengths == [36]

    drafts, logits = mtp_propose(w64, TINY, hidden[:, -1], toks[:, 36], two_cache, num_draft=3)
    assert drafts.shape == (1, 3) and logits.shape == (1, 3, TINY.vocab_size)
    assert torch.equal(drafts, logits.argmax(dim=-1))
    assert two_cache.mtp_lengths == [39]


def test_cache_limits_are_checked(w32: Weights) -> None:
    cache = _cache(2, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_len"):
        forward(w32, TINY, _tokens(13, 2, 33), cache)
    with pytest.raises(ValueError, match="batch"):
        forward(w32, TINY, _tokens(13, 3, 4), cache)
    with pytest.raises(ValueError, match="dtype"):
        forward(w32, TINY, _tokens(13, 2, 4), _cache(2))
    assert cache.lengths == [0, 0]


# ---------------------------------------------------------------- verify steps and mixed steps


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_equal_decode_steps_bitwise(state_dtype: torch.dtype) -> None:
    """The speculative oracle of docs/spec.md at model level: a verify step of K+1 rows computes, bit for bit,
    what K+1 decode steps compute (logits, GDN state, conv window), in the deployment dtype (bf16)."""
    w = init_weights(TINY, seed=0, dtype=torch.bfloat16)
    toks = _tokens(7, 2, 26)
    kw = dict(dtype=torch.bfloat16, kv_dtype="bf16", state_dtype=state_dtype)
    a, b = _cache(2, **kw), _cache(2, **kw)
    forward(w, TINY, toks[:, :21], a)
    forward(w, TINY, toks[:, :21], b)
    verified = forward(w, TINY, toks[:, 21:], a, verify=True)
    decoded = torch.cat([forward(w, TINY, toks[:, i:i + 1], b) for i in range(21, 26)], dim=1)
    assert torch.equal(verified, decoded)
    assert torch.equal(a.layers[0].state, b.layers[0].state)
    assert torch.equal(a.layers[0].conv, b.layers[0].conv)


def test_verify_steps_need_equal_rows() -> None:
    w = init_weights(TINY, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="same number of rows"):
        forward(w, TINY, [_tokens(1, 3), _tokens(2, 2)], _cache(2, dtype=torch.float32), verify=True)


def test_mixed_step_decode_row_equals_decode_alone() -> None:
    """The GDN path is chosen per sequence: a decode row riding in a step with a prefill chunk of
    another sequence gives, bit for bit, what it gives in a decode-only step."""
    w = init_weights(TINY, seed=0, dtype=torch.bfloat16)
    toks, other = _tokens(8, 30), _tokens(9, 12)
    kw = dict(dtype=torch.bfloat16, kv_dtype="bf16")
    mixed, alone = _cache(2, **kw), _cache(2, **kw)
    forward(w, TINY, [toks[:29], other[:1]], mixed)
    forward(w, TINY, [toks[:29], other[:1]], alone)
    got = forward(w, TINY, [toks[29:], other[1:]], mixed)[0]
    want = forward(w, TINY, [toks[29:], other[:0]], alone)[0]
    assert torch.equal(got, want)
