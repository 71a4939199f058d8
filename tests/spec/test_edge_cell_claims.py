"""The edge-case cells' whys are true of the inputs their builders make (CPU, each cell's own seed):
e4m3's range reached in the fp8 store, zero and near-zero vectors into the norms, all-zero nvfp4
blocks, all-equal selection scores, near ties, and rows at page boundaries. Each check measures the
built case, so a builder that stops planting its edge fails it."""

from __future__ import annotations

import pytest
import torch

from certify.catalog.cell_extensions import cell_inputs
from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.harness.target import build_case
from spec.ops.kv_storage import fp8_quantize

pytestmark = pytest.mark.premerge

CATALOG = load_catalog(project_paths().cells)
E4M3_MAX = 448.0
TPB = 32


def _case(op: str, cell: str):
    spec = CATALOG.ops[op]
    c = spec.cell(cell)
    return c.why, build_case(spec.model_copy(update={"inputs": cell_inputs(spec, c)}), c,
                             torch.device("cpu")).inputs


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.double().pow(2).mean(dim=-1).sqrt()


def test_the_fp8_append_reaches_both_ends_of_e4m3_at_page_boundaries_as_its_why_says():
    why, inputs = _case("qsa_kv_append", "verify_b32_k7_fp8")
    for words in ("448", "65280", "inf", "464", "2^-10", "subnormals", "all-zero K vector",
                  "page's last slot", "at its first", "cross a page boundary"):
        assert words in why, words
    k, v, pos = inputs["k"].float(), inputs["v"].float(), inputs["positions"]
    for x in (k, v):
        finite = x[torch.isfinite(x)].abs()
        assert float(finite.max()) == 65280.0 and bool(torch.isinf(x).any())
        assert bool((x.abs() == 464.0).any()) and bool((x.abs() == 448.0).any())
        assert bool((x.abs() == 2.0 ** -10).any()) and bool((x.abs() == 2.0 ** -9).any())
        assert bool((x.abs() == 2.0 ** -11).any())
        codes = fp8_quantize(x).view(torch.uint8)
        assert bool(((codes & 0x7F) == 0x7E)[x.abs() > E4M3_MAX].all())  # saturated to 448
    big_v = (v.abs() > E4M3_MAX).flatten(1).any(dim=1)
    assert int((big_v & (pos % TPB == TPB - 1)).sum()) == 8
    assert int((big_v & (pos % TPB == 0)).sum()) == 8
    zero_k = (k == 0).flatten(1).all(dim=1)
    assert int(zero_k.sum()) == 1 and int(pos[zero_k][0]) % TPB == 0
    # the verify runs cross a page: some request has rows on both sides of a page boundary
    seq = inputs["seq_ids"]
    crossing = [s for s in seq.unique().tolist()
                if len({int(p) // TPB for p in pos[seq == s]}) > 1]
    assert crossing


def test_the_norms_zero_cells_feed_zero_and_near_zero_vectors_as_their_whys_say():
    for op, cell, name in (("rmsnorm", "zero_rows_3072", "x"),
                           ("gated_rmsnorm", "zero_heads_64", "o"),
                           ("qk_norm_rope", "decode_b128_131k", "q"),
                           ("qk_norm_rope", "decode_b128_131k", "k"),
                           ("gdn_decode", "b1_fp32", "q"),
                           ("gdn_decode", "b1_fp32", "k"),
                           ("hc_inject_norm", "zero_rows_t64", "X")):
        why, inputs = _case(op, cell)
        assert "zero" in why and "-0.0" in why and "single nonzero value" in why, op
        x = inputs[name].float()
        x = x.reshape(x.shape[0], -1) if op == "hc_inject_norm" else x.reshape(-1, x.shape[-1])
        zero = (x == 0).all(dim=-1)
        assert int(zero.sum()) >= 2, op
        assert bool((zero & torch.signbit(x).all(dim=-1)).any()), f"{op}: no -0.0 vector"
        assert bool(((x != 0).sum(dim=-1) == 1).any()), f"{op}: no single-value vector"
        rms = _rms(x)
        near = (rms > 0) & (rms <= 1.01e-2)
        assert float(rms[near].min()) <= 1.01e-5 and float(rms[near].max()) >= 0.99e-3, op
    _, inputs = _case("hc_inject_norm", "zero_rows_t64")
    rms = _rms(inputs["X"].reshape(inputs["X"].shape[0], -1))
    r = torch.rsqrt(rms.pow(2) + 1e-6)
    assert int((rms == 0).sum()) == 16 and float(r.max() / r.min()) <= 1.42  # x1.42 apart at most
    for op, cell, name in (("rmsnorm", "zero_rows_3072", "x"), ("gated_rmsnorm", "zero_heads_64", "o")):
        why, inputs = _case(op, cell)
        x = inputs[name].float()
        assert "subnormals" in why
        tiny = x.abs() < torch.finfo(torch.float32).tiny
        assert bool(((x != 0) & tiny).any()), f"{op}: no subnormal"


def test_all_zero_nvfp4_blocks_are_in_the_cells_that_claim_them():
    why, inputs = _case("kv_nvfp4", "decode_b32")
    assert "a block of signed zeros" in why
    blocks = inputs["x"].float().unflatten(-1, (-1, 16))
    assert bool((blocks == 0).all(dim=-1).any())
    why, inputs = _case("moe_nvfp4_experts", "verify_t8_e16")
    assert "padding row" in why and "8 zero blocks" in why
    x = inputs["x"].float()
    T = x.shape[0]
    assert bool((x[T // 2] == 0).all())
    others = [t for t in range(T) if t != T // 2]
    assert bool((x[others].unflatten(-1, (-1, 16)) == 0).all(dim=-1).any(dim=-1).all())
    for name in ("gate", "up", "down"):
        sf, packed = inputs[f"{name}_sf"], inputs[f"{name}_packed"]
        zero_blocks = (sf == 0) & (packed.unflatten(-1, (-1, 8)) == 0).all(dim=-1)
        assert bool((zero_blocks.sum(dim=(1, 2)) >= 8).all()), name


def test_all_equal_score_rows_are_in_the_selection_cells_that_claim_them():
    for op in ("qsa_select", "qsa_topk_expand"):
        why, inputs = _case(op, "decode_edges_2400")
        assert "all-equal scores" in why and "more than k candidates" in why
        scores, pos = inputs["scores"], inputs["positions"]
        # all-equal rows whose t leaves more than k = 64 candidates (complete blocks less the window)
        equal = [r for r in range(scores.shape[0])
                 if bool((scores[r] == scores[r, 0]).all() or torch.isnan(scores[r]).all())
                 and (int(pos[r]) + 1) // TPB - 3 > 64]
        assert len(equal) >= 5, op
        values = {("nan" if torch.isnan(scores[r, 0]) else float(scores[r, 0])) for r in equal}
        assert {"nan", 0.75, float("-inf")} <= values, values
    why, inputs = _case("moe_route", "ties_t128")
    assert "all 512 logits 0" in why
    assert bool((inputs["x"].float() == 0).all(dim=-1).any())  # every logit of that row is 0


def test_the_near_tie_route_cell_has_the_near_ties_and_underflow_its_why_claims():
    why, inputs = _case("moe_route", "near_ties_t128")
    assert "64 rows" in why and "16 rows" in why and "8 rows" in why and "less than 1e-6" in why
    x, w = inputs["x"].double(), inputs["w_router"].double()
    logits = x @ w.T
    s = logits.sort(dim=-1, descending=True).values
    assert float((s[:64, 9] - s[:64, 10]).max()) < 1e-6
    assert float((s[64:80, 2] - s[64:80, 3]).max()) < 1e-6
    p32 = torch.softmax(inputs["x"].float() @ inputs["w_router"].float().T, dim=-1)
    nonzero = (p32[80:88] > 0).sum(dim=-1)
    assert bool((nonzero < 10).all()) and float((s[80:88, 3] - s[80:88, 4]).min()) >= 129.0
    ids32 = torch.sort(p32, dim=-1, descending=True, stable=True).indices[:, :10]
    ids64 = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True,
                       stable=True).indices[:, :10]
    # near ties the fp32 path resolves the other way: rows the bitwise oracle could not pass
    assert int((ids32.sort(dim=-1).values != ids64.sort(dim=-1).values).any(dim=-1)[:80].sum()) > 0


def test_the_ple_zero_update_cell_feeds_zero_vectors_into_the_updates_norm():
    why, inputs = _case("ple_apply", "zero_updates_t16")
    assert "two zero vectors" in why and "RMS 2e-5 to 3e-2" in why
    x = inputs["x"].double()
    gate = torch.nn.functional.gelu(x @ inputs["w_gate"].double().T, approximate="tanh")
    pre = (gate * inputs["e_l"].double()) @ inputs["w_out"].double().T
    rms = _rms(pre)
    assert int((rms == 0).sum()) == 2
    near = rms[(rms > 0) & (rms < 0.05)]
    assert float(near.min()) <= 3e-5 and float(near.max()) >= 2.5e-2 and near.numel() >= 6
    assert bool(((inputs["e_l"] != 0).sum(dim=-1) == 1).any())


def test_the_decode_append_writes_a_pages_last_and_first_slot_as_its_why_says():
    why, inputs = _case("qsa_kv_append", "decode_b128_131k")
    assert "completing its block (offset 31)" in why and "opening a fresh page (offset 0)" in why
    offsets = inputs["positions"] % TPB
    assert bool((offsets == TPB - 1).any()) and bool((offsets == 0).any())
    # the fresh page holds nothing of this request before the step: every slot of it is empty (-1)
    table, pos_plane = inputs["block_table"], inputs["pos_plane"]
    for row in (offsets == 0).nonzero().flatten().tolist():
        seq, t = int(inputs["seq_ids"][row]), int(inputs["positions"][row])
        page = int(table[seq, t // TPB])
        assert bool((pos_plane[page] == -1).all())
