"""Test-only broken variants of the GDN steps: each wrong in a known way, to prove the cells catch it."""

import torch

from impl.kernels.gdn import torch_ops


def verify_state_one_row_late(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out,
                              states):
    """Records, after row t, the state after row t - 1 (and the pool state after row 0)."""
    torch_ops.gdn_verify(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out=out,
                         states=states)
    late = torch.cat([state_pool[slots.long()].unsqueeze(1).to(states.dtype), states[:, :-1]], dim=1)
    states.copy_(late)


def decode_beta_sign_flipped_at_batch_32(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool,
                                         slots, *, out):
    """Correct except in a specialisation for 32 requests, which flips the sign of the beta gate."""
    if q.shape[0] == 32:
        b = -b
    torch_ops.gdn_decode(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out=out)


def gated_rmsnorm_one_percent_high(o, z, w, *, out) -> None:
    """The gated norm, every element 1 % too large."""
    torch_ops.gated_rmsnorm(o, z, w, out=out)
    out.mul_(1.01)


def gated_rmsnorm_dies_once(o, z, w, *, out) -> None:
    """The gated norm, after killing its own process once: the first call in a working directory
    leaves ``died-once.marker`` there and exits at once, as a worker that crashes mid-run does."""
    import os
    from pathlib import Path

    marker = Path("died-once.marker")
    if not marker.exists():
        marker.write_text("died\n")
        os._exit(1)
    torch_ops.gated_rmsnorm(o, z, w, out=out)


def gated_rmsnorm_always_dies(o, z, w, *, out) -> None:
    """Kills its own process on every call, as a unit that crashes every worker it lands on."""
    import os

    os._exit(1)


def gated_rmsnorm_nondeterministic(o, z, w, *, out) -> None:
    """The gated norm plus a different tiny perturbation on every call: its bytes never repeat."""
    import os

    torch_ops.gated_rmsnorm(o, z, w, out=out)
    noise = torch.tensor(int.from_bytes(os.urandom(2), "little") / 65536 * 1e-3, dtype=out.dtype)
    out.add_(noise)
