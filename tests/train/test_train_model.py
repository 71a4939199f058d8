"""The trainable model computes spec/model.py's function: the exported weights run through
spec.model.forward and mtp_draft give the training model's logits (NVFP4 experts on both sides), and
the exported checkpoint loads and generates in the engine.

What is compared, and why in float64: both sides quantise every expert input to NVFP4, a function
with steps of ~1 % of the logits. In fp32 the two sides sum in different orders, and how those sums
round depends on the CPU kernel torch dispatches to (AVX2, AVX512, ...). One element landing on the
other side of one NVFP4 boundary changes its row by a step, and the recurrences carry that step into
every later row (measured in fp32 at seed 3 on one AMD EPYC: 60.5 % of 200 rows within 1e-4 under
DEFAULT dispatch, 99.5 % under AVX2 and AVX512; 60 % was seen under AVX512 on a CPU with AMX). In
float64 the sides differ by ~1e-15 relative (measured: at most 6.3e-15 under DEFAULT, AVX2 and
AVX512), so a flip needs an element within ~1e-15 of a boundary: the comparison no longer depends on
the CPU, and every row is held to 1e-12."""

from __future__ import annotations

import pytest
import torch

from impl.model.admission import Request
from impl.model.checkpoint import load_checkpoint, save_checkpoint
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig, SpeculativeConfig
from impl.train.model import TrainModel
from spec.config import ModelConfig
from spec.model import forward, mtp_draft, new_cache

TINY = ModelConfig.tiny()
T = 200  # 7 blocks: rows past position 159 have more candidates than top_k = 2
F64_ROW_BAND = 1e-12  # relative to the largest logit; measured at most 6.3e-15 (module docstring)


@pytest.fixture(scope="module")
def trained_like():
    """A model whose norms and scales are not at their initial values (a few noisy updates), with
    its NVFP4 calibration filled by one training-mode pass."""
    torch.manual_seed(0)
    model = TrainModel(TINY, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.abs().mean().clamp_min(0.1))
    ids = torch.randint(4, 256, (2, T), generator=torch.Generator().manual_seed(1))
    model.train()
    _, hidden = model(ids, index_loss=True)
    model.draft(hidden, ids, index_loss=True)
    model.eval()
    model.set_qat(True)
    return model, ids


@pytest.fixture(scope="module")
def trained_like_f64(trained_like):
    """The same model in float64, with its exported weights in float64 (module docstring)."""
    model, ids = trained_like
    m64 = TrainModel(TINY, seed=3)
    m64.load_state_dict(model.state_dict())
    m64.double().eval()
    m64.set_qat(True)
    return m64, m64.to_weights(torch.float64), ids


def test_trunk_and_draft_match_the_spec_forward(trained_like_f64):
    model, weights, ids = trained_like_f64
    cache = new_cache(TINY, 1, T + 8, dtype=torch.float64)
    nxt = torch.cat([ids[:1, 1:], torch.full((1, 1), 7)], 1)
    ref_logits, ref_hidden = forward(weights, TINY, ids[:1], cache, return_hidden=True)
    ref_d, _ = mtp_draft(weights, TINY, ref_hidden, nxt, cache)
    with torch.no_grad():
        logits, _ = model(ids[:1])
        d_logits, _ = model.draft(ref_hidden, nxt)   # the same h_prev: the draft layer alone
    for got, ref in ((logits, ref_logits), (d_logits, ref_d)):
        assert got.dtype == ref.dtype == torch.float64
        rel = ((got - ref).abs().amax(-1) / ref.abs().max())[0]
        assert float(rel.max()) < F64_ROW_BAND, rel
    # the sparse path really chooses: late rows attend fewer blocks than they have
    sel = model.qsa_layers()[0].selection
    assert int(sel[0, -1].sum()) == 5 and sel.shape[-1] == 7


def test_exported_checkpoint_runs_in_the_engine(trained_like, tmp_path):
    model, ids = trained_like
    path = tmp_path / "tiny.safetensors"
    save_checkpoint(path, model.to_weights(), TINY, metadata={"steps": "0"})
    assert path.stat().st_size < 16 * 2**20
    ckpt = load_checkpoint(path, dtype=torch.bfloat16)
    config = EngineConfig(model="tiny", max_batch_size=2, max_num_tokens=64, max_seq_len=96,
                          speculative=SpeculativeConfig(draft_length=2))
    report = Engine(config, ckpt.weights, cfg=ckpt.cfg).generate(
        [Request(request_id="a", prompt=tuple(ids[0, :40].tolist()), max_new_tokens=6)])
    assert len(report.results["a"].tokens) == 6


def test_draft_chain_matches_the_engines_one_row_draft_steps(trained_like_f64):
    """Draft steps 2 and 3 of a chain, all rows at once (``attend_chain``), against spec's one-row
    draft passes after the draft layer read rows 0..n-1 from the trunk, in float64 (module
    docstring)."""
    model, weights, ids = trained_like_f64
    n = 180
    cache = new_cache(TINY, 1, T + 8, dtype=torch.float64)
    _, ref_hidden = forward(weights, TINY, ids[:1, :n], cache, return_hidden=True)
    _, h = mtp_draft(weights, TINY, ref_hidden, ids[:1, 1:n + 1], cache)
    ref_steps = []
    for j in (2, 3):
        logits_j, h = mtp_draft(weights, TINY, h[:, -1:], ids[:1, n + j - 1:n + j], cache)
        ref_steps.append(logits_j[0, 0])
    with torch.no_grad():
        _, hidden = model(ids[:1, :n])
        seq = ids[:1, :n + 3]
        nxt = seq[:, 1:]
        h_prev = torch.cat([hidden, torch.zeros_like(hidden[:, :2])], 1)
        chain, got = None, []
        for j in (1, 2, 3):
            d_logits, m = model.draft(h_prev, nxt, chain=chain)
            kv = model.mtp_layer.mixer.kv
            chain = [kv] if chain is None else chain + [kv]
            if j > 1:
                got.append(d_logits[0, n + j - 2])
            h_prev = torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], 1)
    for a, b in zip(got, ref_steps):
        assert a.dtype == b.dtype == torch.float64
        assert float((a - b).abs().max() / b.abs().max()) < F64_ROW_BAND
        assert int(a.argmax()) == int(b.argmax())


def test_index_loss_is_zero_not_nan_when_no_row_chooses():
    """Sequences of at most sink + local + top_k blocks leave the index nothing to choose: its loss
    is a finite 0 (the training log read NaN there while the -inf scores of non-candidate blocks
    were multiplied by 0)."""
    model = TrainModel(TINY, seed=3)
    model.train()
    short = torch.randint(4, 256, (3, 5 * TINY.tokens_per_block - 3),
                          generator=torch.Generator().manual_seed(2))
    model(short, index_loss=True)
    losses = [q.index_loss for q in model.qsa_layers()]
    assert all(bool(torch.isfinite(x)) and float(x.detach()) == 0.0 for x in losses)
    model(torch.randint(4, 256, (2, T), generator=torch.Generator().manual_seed(3)), index_loss=True)
    assert all(float(q.index_loss.detach()) > 0 for q in model.qsa_layers())  # rows past 159 choose


def test_index_loss_row_weights_reweight_the_mean_over_choosing_rows():
    """Uniform weights give the plain mean; weight on one row gives that row's KL alone; rows where
    selection does not choose count for nothing whatever their weight."""
    model = TrainModel(TINY, seed=3)
    model.train()
    ids = torch.randint(4, 256, (2, T), generator=torch.Generator().manual_seed(4))

    def loss(weights):
        model(ids, index_loss=True, index_rows=weights)
        return torch.stack([q.index_loss.detach() for q in model.qsa_layers()])

    plain = loss(None)
    assert torch.allclose(loss(torch.full((2, T), 3.0)), plain, rtol=1e-6)
    one_row, other_row = torch.zeros(2, T), torch.zeros(2, T)
    one_row[1, T - 1] = 1.0
    other_row[0, 170] = 1.0
    a, b = loss(one_row), loss(other_row)
    assert not torch.allclose(a, b) and not torch.allclose(a, plain)
    # a row before position 160 has at most top_k candidates: weighting it alone leaves nothing
    early = torch.zeros(2, T)
    early[:, :150] = 1.0
    assert torch.all(loss(early) == 0)


def test_selection_hinge_is_zero_exactly_when_the_peak_is_selected_with_the_margin():
    """With top_k = 2 the peak block must outrank every other candidate but one by the margin: the
    hinge is m - (s_peak - s_2nd_other) below that, 0 above; non-candidates and rows with at most
    top_k candidates never count; its gradient raises the peak and lowers the competitor."""
    from impl.train.model import selection_hinge
    cand = torch.tensor([[False, True, True, True, True],      # 4 candidates: chooses
                         [False, True, True, False, False]])   # 2 candidates: nothing to outrank
    scores = torch.tensor([[[9.0, 1.0, 5.0, 3.0, 2.5],     # peak 2 leads 2nd other (3.0) by 2.0
                            [9.0, 1.0, 3.2, 5.0, 3.0],     # peak 2 leads 2nd other (3.0) by 0.2
                            [9.0, 4.0, 0.0, 5.0, 3.0],     # peak 2 ranks last: gap -4
                            [0.0, 0.0, 0.0, 0.0, 0.0]]], requires_grad=True)
    peak = torch.tensor([[2, 2, 2, 0]])                     # row 3: the sink, not a candidate
    rows = torch.tensor([[0, 0, 0, 0]])
    h = selection_hinge(scores, cand[rows[0]], peak, 2, 1.0)
    assert h.shape == (1, 4)
    assert h[0, 0] == 0.0 and h[0, 3] == 0.0                # selected with margin; peak not a candidate
    assert torch.isclose(h[0, 1], torch.tensor(0.8)) and torch.isclose(h[0, 2], torch.tensor(5.0))
    h.sum().backward()
    g = scores.grad[0]
    assert g[1, 2] == -1 and g[1, 4] == 1 and g[1, 3] == 0  # up the peak, down the 2nd other (3.0)
    assert g[2, 2] == -1 and g[2, 1] == 1                   # the 2nd other there is block 1 (4.0)
    assert torch.all(g[:, 0] == 0)                          # the sink is never a candidate
    few = selection_hinge(scores.detach()[:, :2], cand[1:2].expand(1, 5), peak[:, :2], 2, 1.0)
    assert torch.all(few == 0)                              # one other candidate: nothing to outrank


def test_index_margin_adds_the_hinge_on_its_rows_only():
    """index_kl with a margin on no row equals the plain loss; on the last row it adds that row's
    hinge, which the margin sets: a larger margin never lowers it."""
    model = TrainModel(TINY, seed=3)
    model.train()
    ids = torch.randint(4, 256, (2, T), generator=torch.Generator().manual_seed(4))

    def loss(rows, m):
        model(ids, index_loss=True, index_margin=None if rows is None else (rows, m))
        return torch.stack([q.index_loss.detach() for q in model.qsa_layers()])

    plain = loss(None, 0.0)
    none = torch.zeros(2, T, dtype=torch.bool)
    assert torch.equal(loss(none, 1.0), plain)
    last = none.clone()
    last[:, T - 1] = True
    small, large = loss(last, 0.5), loss(last, 50.0)
    assert torch.all(large > plain) and torch.all(large >= small) and torch.all(small >= plain)
