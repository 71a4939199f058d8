"""The catalog's hyper-connection adapter against the per-token formulation (docs/spec.md,
"Hyper-connections" step 2): ``hc_first_projection_op`` on the decode cell's own inputs at the
target geometry (n = 4 streams, C = 3072), in float64, against ``second_first_projection`` (per
token, an fsum dot per logit, closed-form sigmoids, a plain Sinkhorn loop without the max shift),
the formulation ``hc_first_projection`` itself is checked against.

Tolerance, derived from the inputs: a logit is a dot of n C = 12288 terms, exact on the fsum side
and within n C u sum_i |v_i r Phi_ik| (u = 2^-53) on the spec's, so the logits differ by at most
that bound; a sigmoid moves by at most a quarter of it (H_post by half), and exp(l_res) by the same
relative amount, which Sinkhorn's 20 divisions carry to H_res up to a factor of a few (each round
adds about 4 u). The test takes four times the logit bound: 3.0e-10 on the decode cell, where the
measured worst difference is 1.1e-15; the wrong variants are off by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.harness.target import build_case
from spec.cases.hc import hc_first_projection_op
from tests.spec.test_second_formulations_model import second_first_projection

pytestmark = pytest.mark.premerge

CATALOG = load_catalog(project_paths().cells)
F64 = torch.float64


def _close(a, b, tol: float) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=0.0, atol=tol)


@pytest.mark.second_formulation("spec.cases.hc:hc_first_projection_op")
def test_first_projection_op_equals_per_token_logits_on_the_decode_cell():
    op = CATALOG.ops["hc_first_projection"]
    x = build_case(op, op.cell("decode_t1"), torch.device("cpu")).inputs
    v, r, phi, bias = (x[n].to(F64) for n in ("v", "r", "phi", "bias"))
    got = hc_first_projection_op(v, r, phi, bias)
    n = got["h_pre"].shape[-1]
    assert n == 4 and v.shape[-1] == n * 3072
    pre, post, res = second_first_projection(v, r, phi, bias, n)
    terms = ((v * r[:, None]).abs() @ phi.abs()).max()          # max_k sum_i |v_i r Phi_ik|
    tol = 4.0 * v.shape[-1] * 2.0 ** -53 * float(terms)
    assert tol < 1e-8
    assert got["h_res"].dtype == F64
    assert _close(got["h_pre"], pre, tol) and _close(got["h_post"], post, tol)
    assert _close(got["h_res"], res, tol)
    # wrong: l_res read column-major; H_post without its factor 2.
    assert not _close(got["h_res"], second_first_projection(v, r, phi, bias, n,
                                                            res_col_major=True)[2], tol)
    assert not _close(got["h_post"], second_first_projection(v, r, phi, bias, n,
                                                             post_times_two=False)[1], tol)
