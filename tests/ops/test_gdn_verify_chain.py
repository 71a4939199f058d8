"""A verify step over T rows is T one-row steps chained through a bf16 pool, bit for bit.

The bf16 state pool is a rounding point after every row (docs/spec.md, "GDN layer"): the state
row t+1 starts from is row t's state as stored. So a T-row verify must equal T one-row verifies, each
starting from a pool that holds the previous one's recorded state. A path that keeps the state in
fp32 between the rows of one launch (and rounds only what it records) fails this; the cells' bands
do not see it.
"""

from __future__ import annotations

import pytest
import torch

from impl.kernels.gdn import torch_ops
from spec.ops import gdn

B, T, HK, HV, K, V, POOL = 2, 3, 1, 2, 16, 16, 4


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return {"q": r(B, T, HK, K).bfloat16(), "k": r(B, T, HK, K).bfloat16(),
            "v": r(B, T, HV, V).bfloat16(), "a": r(B, T, HV).bfloat16(),
            "b": r(B, T, HV).bfloat16(), "A_log": r(HV) * 0.5, "dt_bias": r(HV) * 0.5,
            "z": r(B, T, HV, V).bfloat16(), "norm_w": 1.0 + 0.1 * r(V),
            "state_pool": (0.3 * r(POOL, HV, K, V)).bfloat16(),
            "slots": torch.tensor([1, 3])}


def _spec(**x) -> tuple[torch.Tensor, torch.Tensor]:
    res = gdn.gdn_verify(**x)
    return res["out"], res["states"].to(x["state_pool"].dtype)


def _torch(**x) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x["q"].shape[1]
    out = torch.empty(B, rows, HV, V, dtype=torch.bfloat16)
    states = torch.empty(B, rows, HV, K, V, dtype=x["state_pool"].dtype)
    torch_ops.gdn_verify(**x, out=out, states=states)
    return out, states


@pytest.mark.certify_property("gdn_verify")
@pytest.mark.parametrize("verify", [_spec, _torch], ids=["spec", "torch"])
def test_a_verify_is_its_rows_chained_through_the_bf16_pool(verify):
    x = _inputs(28)
    out, states = verify(**x)
    pool = x["state_pool"].clone()
    for t in range(T):
        row = {n: (v[:, t:t + 1] if n in ("q", "k", "v", "a", "b", "z") else v) for n, v in x.items()}
        row["state_pool"] = pool.clone()
        out_t, states_t = verify(**row)
        assert torch.equal(out_t[:, 0], out[:, t]), f"row {t}: out"
        assert torch.equal(states_t[:, 0], states[:, t]), f"row {t}: state"
        pool[x["slots"]] = states_t[:, 0]
