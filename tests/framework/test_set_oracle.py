"""The set oracle of selections (certify.harness.set_oracle) and the cell fields that use it
(certify.catalog.cell_extensions): each check fails on the bug it names, and a cell without the new
fields keeps the content hash it had."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from certify.catalog.cell_extensions import ExtendedCell
from certify.catalog.callables import callable_errors
from certify.catalog.load import Catalog, load_catalog, load_op_file
from certify.files.problem import FileProblem
from certify.catalog.schema import Cell
from certify.files.paths import project_paths
from certify.harness.extended import certify_cell
from certify.harness.oracles import INT_POISON
from certify.harness.set_oracle import check_selection
from certify.harness.target import SpecVariant, resolve
from certify.receipts.codehash import content_hash

pytestmark = pytest.mark.premerge

SCORES = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0],
                       [3.0, 2.0, 3.0, 3.0 + 1e-9, 0.5]], dtype=torch.float64)
BOUND = torch.full_like(SCORES, 1e-6)


def _check(ids, ordered=False, bound=BOUND):
    return check_selection("ids", torch.tensor(ids), SCORES, bound, ordered)


def test_a_float64_top_k_passes_and_a_near_tie_either_way_passes():
    assert _check([[0, 1], [3, 0]], ordered=True).passed
    v = _check([[0, 1], [0, 2]])  # 2 for 3: a near tie resolved the other way
    assert v.passed and v.metrics["ids.rows_off_float64"] == 1.0


@pytest.mark.parametrize("ids, words", [
    ([[0, 1], [3, 5]], "outside [0, 5)"),
    ([[0, 1], [3, -1]], "outside [0, 5)"),
    ([[0, 1], [3, INT_POISON[torch.int64]]], "never written"),
    ([[0, 0], [3, 0]], "repeat an id"),
    ([[0, 2], [3, 0]], "no top-2"),
])
def test_each_broken_selection_fails_naming_its_fault(ids, words):
    v = _check(ids)
    assert not v.passed and words in "\n".join(v.problems)


def test_the_bound_decides_a_near_tie_and_the_order():
    assert not _check([[0, 1], [0, 2]], bound=torch.zeros_like(SCORES)).passed
    assert not _check([[1, 0], [3, 0]], ordered=True).passed   # 4 listed before 5
    assert _check([[1, 0], [3, 0]], ordered=False).passed
    assert _check([[0, 1], [0, 3]], ordered=True).passed       # 3 before 3 + 1e-9: within the bound


MOE_ROUTE = load_catalog(project_paths().cells).ops["moe_route"]
NEAR_TIES = MOE_ROUTE.cell("near_ties_t128")


def test_the_near_tie_cell_fails_a_router_that_picks_the_eleventh_expert():
    spec = resolve(MOE_ROUTE.spec)

    def eleventh(**kw):
        ids, weights = kw.pop("expert_ids"), kw.pop("weights")
        got_ids, _ = spec(**kw)
        p = torch.softmax(kw["x"].float() @ kw["w_router"].float().T, dim=-1)
        order = torch.sort(p, dim=-1, descending=True, stable=True).indices
        got_ids[:, -1] = order[:, 10]
        ids.copy_(got_ids)
        sel = torch.gather(p, -1, got_ids)
        weights.copy_(sel / sel.sum(dim=-1, keepdim=True))

    out = certify_cell(MOE_ROUTE, "spec_lowp", NEAR_TIES, "cpu", impl_override=eleventh)
    assert out.status == "failed" and "no top-10" in out.message


def test_the_near_tie_cell_fails_weights_not_renormalised():
    spec = SpecVariant(resolve(MOE_ROUTE.spec))

    def raw_weights(**kw):
        spec(**kw)
        p = torch.softmax(kw["x"].float() @ kw["w_router"].float().T, dim=-1)
        kw["weights"].copy_(torch.gather(p, -1, kw["expert_ids"]))

    spec.outputs = ["expert_ids", "weights"]
    out = certify_cell(MOE_ROUTE, "spec_lowp", NEAR_TIES, "cpu", impl_override=raw_weights)
    assert out.status == "failed" and "weights" in out.message
    assert certify_cell(MOE_ROUTE, "spec_lowp", NEAR_TIES, "cpu").status == "passed"


def test_a_cell_without_the_new_fields_hashes_as_a_plain_cell():
    for cell in MOE_ROUTE.cells:
        if isinstance(cell, ExtendedCell) and cell.inputs is None and cell.selection is None:
            plain = Cell(**{n: getattr(cell, n) for n in Cell.model_fields})
            assert content_hash(MOE_ROUTE, "spec_lowp", cell) == \
                content_hash(MOE_ROUTE, "spec_lowp", plain)


def test_the_selection_and_the_cells_builder_enter_the_hash():
    base = content_hash(MOE_ROUTE, "spec_lowp", NEAR_TIES)
    ordered = NEAR_TIES.model_copy(update={"selection": NEAR_TIES.selection.model_copy(
        update={"ordered": False})})
    other_builder = NEAR_TIES.model_copy(update={"inputs": "spec.cases.moe:route_case"})
    assert content_hash(MOE_ROUTE, "spec_lowp", ordered) != base
    assert content_hash(MOE_ROUTE, "spec_lowp", other_builder) != base


def _moe_route_text() -> str:
    return (project_paths().cells / "moe_route.yaml").read_text()


@pytest.mark.parametrize("edit, field, words", [
    (("      given: spec.ops.moe_route_sets:route_weights_given\n", ""), "given",
     "need the spec's result"),
    (("    selection:\n      ids: expert_ids\n", "    selection:\n      ids: weights\n"), "outputs",
     "judged by the selection"),
    (("      ordered: true\n", "      ordered: true\n      tolerance: 3\n"), "tolerance",
     "unknown field"),
])
def test_a_bad_selection_names_file_line_and_field(tmp_path, edit, field, words):
    text = _moe_route_text()
    assert edit[0] in text
    path = tmp_path / "moe_route.yaml"
    path.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(FileProblem) as e:
        load_op_file(path)
    assert e.value.line and field in e.value.field and words in str(e.value), str(e.value)


def test_certify_check_names_a_cell_builder_that_does_not_resolve(tmp_path):
    path = tmp_path / "moe_route.yaml"
    path.write_text(_moe_route_text().replace("spec.cases.moe_edges:route_near_ties_case",
                                              "spec.cases.moe_edges:no_such_builder"))
    cat = Catalog(ops={"moe_route": load_op_file(path)}, files={"moe_route": path})
    problems = callable_errors(cat)
    assert len(problems) == 1 and "no_such_builder" in str(problems[0])
    assert problems[0].field.endswith("inputs")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), rows=st.integers(1, 6), n=st.integers(2, 40),
       data=st.data())
def test_the_float64_top_k_passes_and_a_swap_past_the_bound_fails(seed, rows, n, data):
    k = data.draw(st.integers(1, n - 1))
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    bound = torch.rand(rows, n, generator=gen, dtype=torch.float64) * 1e-3
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    assert check_selection("ids", top, scores, bound, ordered=True).passed
    shuffled = top[:, torch.randperm(k, generator=gen)]
    assert check_selection("ids", shuffled, scores, bound, ordered=False).passed
    # swap the k-th best for a left-out id that is below it by more than both bounds
    row = data.draw(st.integers(0, rows - 1))
    rest = torch.sort(scores[row], descending=True, stable=True).indices[k:]
    kth = int(top[row, -1])
    far = [int(j) for j in rest if scores[row, kth] - scores[row, j] > bound[row, kth] + bound[row, j]]
    if far:
        bad = top.clone()
        bad[row, -1] = far[0]
        assert not check_selection("ids", bad, scores, bound).passed
