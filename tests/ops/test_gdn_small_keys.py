"""GDN rows whose q and k are of the order of sqrt(eps): where the l2norm's eps (inside the square
root, docs/spec.md, "GDN layer") decides the result.

The cells draw q and k of norm near sqrt(128), where eps = 1e-6 moves the normalised key by 1e-8
relative; an eps added outside the square root passes them. Keys of norm 1e-3 put eps at half of the
sum of squares, so every variant must follow the spec's placement there.
"""

from __future__ import annotations

import pytest
import torch

from impl.kernels.gdn import torch_ops, triton_fused, triton_split
from spec.ops import gdn

B, T, HK, HV, K, V, POOL = 2, 2, 1, 2, 16, 64, 3   # V = 64: two of the split kernel's 32-column tiles


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    small = 1e-3 / 4.0   # a 16-element row of N(0, 1) * this has norm near 1e-3
    return {"q": (r(B, T, HK, K) * small).bfloat16(), "k": (r(B, T, HK, K) * small).bfloat16(),
            "v": r(B, T, HV, V).bfloat16(), "a": r(B, T, HV).bfloat16(),
            "b": r(B, T, HV).bfloat16(), "A_log": r(HV) * 0.5, "dt_bias": r(HV) * 0.5,
            "z": r(B, T, HV, V).bfloat16(), "norm_w": 1.0 + 0.1 * r(V),
            "state_pool": 0.3 * r(POOL, HV, K, V), "slots": torch.tensor([2, 0])}


@pytest.mark.certify_property("gdn_verify")
@pytest.mark.parametrize("module", [torch_ops, triton_fused, triton_split],
                         ids=["torch", "triton_fused", "triton_split"])
def test_a_verify_with_keys_at_the_scale_of_eps_follows_the_spec(module):
    x = _inputs()
    out = torch.empty(B, T, HV, V, dtype=torch.bfloat16)
    states = torch.empty(B, T, HV, K, V, dtype=torch.float32)
    module.gdn_verify(**x, out=out, states=states)
    ref = gdn.gdn_verify(**{n: (v.double() if v.is_floating_point() else v) for n, v in x.items()})
    s_err = (states.double() - ref["states"]).abs().max() / ref["states"].abs().max()
    assert s_err.item() < 1e-5, f"states: {s_err.item():.3g} relative"
    o_err = (out.double() - ref["out"]).abs() / ref["out"].abs().amax(dim=-1, keepdim=True)
    assert o_err.max().item() <= 2 ** -6, f"out: {o_err.max().item():.3g} of the row maximum"


@pytest.mark.certify_property("gdn_decode")
@pytest.mark.parametrize("module", [torch_ops, triton_fused, triton_split],
                         ids=["torch", "triton_fused", "triton_split"])
def test_a_decode_with_keys_at_the_scale_of_eps_follows_the_spec(module):
    x = {n: (v[:, 0].contiguous() if n in ("q", "k", "v", "a", "b", "z") else v)
         for n, v in _inputs().items()}
    ref = gdn.gdn_decode(**{n: (v.double() if v.is_floating_point() else v) for n, v in x.items()})
    out = torch.empty(B, HV, V, dtype=torch.bfloat16)
    module.gdn_decode(**x, out=out)   # the pool's rows at the slots are updated in place
    s_err = (x["state_pool"].double() - ref["state_pool"]).abs().max() / ref["state_pool"].abs().max()
    assert s_err.item() < 1e-5, f"state: {s_err.item():.3g} relative"
    o_err = (out.double() - ref["out"]).abs() / ref["out"].abs().amax(dim=-1, keepdim=True)
    assert o_err.max().item() <= 2 ** -6, f"out: {o_err.max().item():.3g} of the row maximum"
