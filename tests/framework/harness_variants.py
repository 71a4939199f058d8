"""Test-only variants of the gated norm and the GDN decode step, each wrong in a way its output
alone does not show: the harness checks (``certify.harness.checks``) must catch them."""

import torch

from impl.kernels.gdn import torch_ops
from impl.kernels.layout import require_contiguous


def norm_clean(o, z, w, *, out) -> None:
    """The torch composition as it is: every check passes."""
    torch_ops.gated_rmsnorm(o, z, w, out=out)


def norm_writes_one_past_its_output(o, z, w, *, out) -> None:
    """Right results, then one element written past the end of ``out`` (a tail not masked)."""
    torch_ops.gated_rmsnorm(o, z, w, out=out)
    flat = torch.as_strided(out, (out.numel() + 1,), (1,), out.storage_offset())
    flat[-1] = 0.0


def norm_scribbles_on_its_input(o, z, w, *, out) -> None:
    """Right results, then uses ``o`` as scratch space."""
    torch_ops.gated_rmsnorm(o, z, w, out=out)
    o[-1, -1, -1] = 0.0


def norm_reads_its_stale_output(o, z, w, *, out) -> None:
    """Accumulates into ``out`` instead of overwriting it, reading NaN (the poison) as zero: right
    on a freshly poisoned buffer, wrong on one that holds an earlier result."""
    stale = torch.nan_to_num(out.float(), nan=0.0)
    res = torch.empty_like(out)
    torch_ops.gated_rmsnorm(o, z, w, out=res)
    out.copy_(res.float() + stale)


def norm_small_batches_rounded_otherwise(o, z, w, *, out) -> None:
    """A specialisation for launches of fewer than 8 rows that rounds through fp16: a row's result
    depends on the batch size it is launched in."""
    torch_ops.gated_rmsnorm(o, z, w, out=out)
    if o.shape[0] < 8:
        out.copy_(out.to(torch.float16).to(out.dtype) * 1.0078125)


def norm_ignores_strides(o, z, w, *, out) -> None:
    """Reads ``o`` as if it were contiguous, as a kernel handed a raw pointer without strides."""
    flat = torch.as_strided(o, o.shape, torch.empty(o.shape).stride(), o.storage_offset())
    torch_ops.gated_rmsnorm(flat, z, w, out=out)


def decode_writes_a_spare_pool_row(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *,
                                   out) -> None:
    """Right results, then one pool row no request owns overwritten."""
    torch_ops.gdn_decode(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out=out)
    spare = next(i for i in range(state_pool.shape[0]) if i not in set(slots.tolist()))
    state_pool[spare].zero_()


def norm_refuses_views(o, z, w, *, out) -> None:
    """Refuses what it would read wrongly, as the kernels' layout contract does."""
    require_contiguous("the planted norm", o=o, z=z, w=w)
    torch_ops.gated_rmsnorm(o, z, w, out=out)

