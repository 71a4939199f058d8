"""Triton kernels of a hyper-connection site's stream steps (spec/ops/hc.py;
docs/spec.md, "Hyper-connections"): the inject + norm, the pre-mix and the up projection with its stream mean.

- ``hc_inject_norm``: one program per token reads the n*C fp32 stream values once, writes v (a copy)
  and r = 1 / sqrt(mean(v^2) + eps). The mean square is a 4096-lane fp32 accumulator (three values a
  lane at n*C = 12288) then Triton's tree sum (12 levels): at most 16 roundings a term, the bound the
  cell's band derives for torch's pairwise sum (<= 17). The mean, + eps, the square root and the
  reciprocal round once each (``div_rn``, ``sqrt_rn``).
- ``hc_pre``: x_in = sum_j H_pre[j] X[j] in fp32, stream 0 first, every product and sum rounded on its
  own (no fused multiply-add: ``enable_fp_fusion=False``), then one rounding to bf16 on the bits. These
  are the spec's operations in the spec's order, so the result is the spec's to the bit.
- ``hc_first_projection``: the torch variant's fp32 GEMM and gates (impl/kernels/hc/torch_hc.py),
  then the 20 Sinkhorn rounds on each token's n x n matrix in one launch, where the spec's tensor
  loop takes 80: each sum of n terms is Triton's tree sum, each division correctly rounded
  (``div_rn``); no rounding point.
- ``hc_up_projection``: X'[i] = sum_j H_res[i, j] X[j] + H_post[i] y and m = (X'[0] + ... + X'[n-1]) / n
  in the spec's order, unfused, with 1/n exact for n a power of two: the spec's bits.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.hc.torch_hc import first_projection_gates
from impl.kernels.triton_support import INTERPRETING, round_to_bf16
from spec.ops.hc import SINKHORN_ITERS

EPS = 1e-6          # spec/ops/hc.py:EPS
NORM_LANES = 4096   # the inject norm's accumulator lanes
BLOCK_C = 1024      # channels a program of the pre-mix and the up projection
# Tokens a program of the Sinkhorn rounds, and its warps: one warp's reductions over 8 tokens' 4 x 4
# matrices need no shared memory (bench/hc_sinkhorn.py; the same bits as 32 tokens on 4 warps).
SINKHORN_TOKENS = 8
SINKHORN_WARPS = 1
# The compiled kernels keep every product and sum apart, as the spec's tensor ops do; the
# interpreter evaluates each operation on its own anyway.
_UNFUSED = {} if INTERPRETING else {"enable_fp_fusion": False}


@triton.jit
def _inject_norm_kernel(X, v, r, eps, NC: tl.constexpr, LANES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([LANES], dtype=tl.float32)
    for start in tl.static_range(0, NC, LANES):
        offs = start + tl.arange(0, LANES)
        mask = offs < NC
        x = tl.load(X + row * NC + offs, mask=mask, other=0.0)
        tl.store(v + row * NC + offs, x, mask=mask)
        acc += x * x
    mean = tl.math.div_rn(tl.sum(acc, axis=0), NC * 1.0)
    tl.store(r + row, tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps)))


@triton.jit
def _pre_kernel(X, h_pre, x_in, N: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    base = X + row * N * C + offs
    total = tl.load(h_pre + row * N) * tl.load(base, mask=mask, other=0.0)
    for j in tl.static_range(1, N):
        total = total + tl.load(h_pre + row * N + j) * tl.load(base + j * C, mask=mask, other=0.0)
    tl.store(x_in + row * C + offs, round_to_bf16(total).to(tl.bfloat16), mask=mask)


@triton.jit
def _up_kernel(X, y, h_res, h_post, X_new, m, N: tl.constexpr, C: tl.constexpr,
               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    base = X + row * N * C + offs
    yv = tl.load(y + row * C + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(N):
        s = tl.load(h_res + row * N * N + i * N) * tl.load(base, mask=mask, other=0.0)
        for j in tl.static_range(1, N):
            s = s + tl.load(h_res + row * N * N + i * N + j) * tl.load(base + j * C, mask=mask,
                                                                         other=0.0)
        s = s + tl.load(h_post + row * N + i) * yv
        tl.store(X_new + row * N * C + i * C + offs, s, mask=mask)
        if i == 0:
            mean = s
        else:
            mean = mean + s
    tl.store(m + row * C + offs, mean * (1.0 / N), mask=mask)


@triton.jit
def _sinkhorn_kernel(M, out, T, iters, N: tl.constexpr, BT: tl.constexpr):
    # BT tokens a program, each an N x N matrix; columns then rows normalised, ``iters`` rounds.
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    i = tl.arange(0, N)
    j = tl.arange(0, N)
    offs = t[:, None, None] * (N * N) + i[None, :, None] * N + j[None, None, :]
    live = (t < T)[:, None, None]
    m = tl.load(M + offs, mask=live, other=1.0)
    for _ in range(iters):
        m = tl.div_rn(m, tl.sum(m, axis=1)[:, None, :])   # columns sum to 1
        m = tl.div_rn(m, tl.sum(m, axis=2)[:, :, None])   # rows sum to 1
    tl.store(out + offs, m, mask=live)


def _check_streams(X: torch.Tensor) -> tuple[int, int, int]:
    if X.dtype != torch.float32 or X.dim() != 3 or not X.is_contiguous():
        raise ValueError("the Triton HC kernels read contiguous fp32 streams X [T, n, C]")
    return X.shape


def hc_inject_norm(X: torch.Tensor, eps: float = EPS, *, v: torch.Tensor, r: torch.Tensor) -> None:
    """X [T, n, C] fp32 -> v [T, n*C] fp32 (X flattened, stream 0 first), r [T] fp32."""
    T, n, C = _check_streams(X)
    if T == 0:
        return
    _inject_norm_kernel[(T,)](X, v, r, eps, NC=n * C, LANES=NORM_LANES, num_warps=8)


def hc_first_projection(v: torch.Tensor, r: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, *,
                        h_pre: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> None:
    """v [T, n*C], r [T], phi [n*C, 2n + n^2], bias [2n + n^2] -> h_pre, h_post [T, n], h_res
    [T, n, n] (fp32 buffers, written completely): the torch variant's GEMM and gates, then the
    Sinkhorn rounds in one launch."""
    M = first_projection_gates(v, r, phi, bias, h_pre, h_post).contiguous()
    T, n = M.shape[0], M.shape[-1]
    if n & (n - 1) or not h_res.is_contiguous():
        raise ValueError(f"the Triton Sinkhorn takes a power-of-two n ({n}) and a contiguous h_res")
    if T == 0:
        return
    _sinkhorn_kernel[(triton.cdiv(T, SINKHORN_TOKENS),)](M, h_res, T, SINKHORN_ITERS, N=n,
                                                        BT=SINKHORN_TOKENS, num_warps=SINKHORN_WARPS)


def hc_pre(X: torch.Tensor, h_pre: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16, *,
           x_in: torch.Tensor) -> None:
    """X [T, n, C] fp32, h_pre [T, n] fp32 -> x_in [T, C] bf16."""
    T, n, C = _check_streams(X)
    if act_dtype != torch.bfloat16 or x_in.dtype != torch.bfloat16:
        raise ValueError("the Triton pre-mix rounds to bf16")
    if T == 0:
        return
    grid = (T, triton.cdiv(C, BLOCK_C))
    _pre_kernel[grid](X, h_pre.contiguous(), x_in, N=n, C=C, BLOCK=BLOCK_C, num_warps=4,
                      **_UNFUSED)


def hc_up_projection(X: torch.Tensor, y: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor,
                     *, X_new: torch.Tensor, m: torch.Tensor) -> None:
    """X [T, n, C] fp32, y [T, C] (bf16 or fp32, widened exactly), h_res [T, n, n], h_post [T, n]
    fp32 -> X_new [T, n, C] fp32, m [T, C] fp32."""
    T, n, C = _check_streams(X)
    if n & (n - 1):
        raise ValueError(f"the stream mean multiplies by 1/n, exact only for n a power of two: {n}")
    if T == 0:
        return
    grid = (T, triton.cdiv(C, BLOCK_C))
    _up_kernel[grid](X, y.contiguous(), h_res.contiguous(), h_post.contiguous(), X_new, m, N=n, C=C,
                     BLOCK=BLOCK_C, num_warps=4, **_UNFUSED)
