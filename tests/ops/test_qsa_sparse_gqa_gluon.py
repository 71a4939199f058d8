"""The Gluon nvfp4 decode kernel (impl/kernels/qsa/gluon_sparse_gqa.py) on a machine without a GPU.

Its numerics are certified on sm_90 only (Gluon has no interpreter: reports/receipts/sm_90.jsonl,
cell decode_b8_8k_nvfp4). What the CPU can check: that the host-side gathers of q and of the output
columns name exactly the elements the kernel's in-register reshape / permute puts on each logical
index (a mismatch would pair q with the wrong elements of K, or store o's columns in the wrong place,
and only the GPU receipt would notice), that the kernel compiles for sm_90 with every operand
conversion proved free of data movement (tools/sm90_compile_check.py), and that the wrapper refuses
what it cannot run."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from impl.kernels.qsa import gluon_sparse_gqa as gsg
from spec.cases.qsa import sparse_gqa_case

ROOT = Path(__file__).resolve().parents[2]


def _kernel_view(x_phys: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """What ``_decoded_operand`` does to a [tokens, d] tile in physical order, in torch: split d into
    (byte, nibble) = the join of the decoder's low and high outputs, view one axis of 2 per bit,
    permute to the logical order, flatten."""
    n, d = x_phys.shape
    bytes_then_nibble = x_phys.reshape(n, d // 2, 2)          # d = 2 * byte + nibble
    split = bytes_then_nibble.reshape(gsg._SPLIT.value)
    return split.permute(order).reshape(n, d)


@pytest.mark.parametrize("which", ["K", "V"])
def test_logical_order_matches_the_host_tables(which: str) -> None:
    d = gsg.HEAD_DIM
    phys = torch.arange(d).repeat(gsg.TILE, 1)                  # each element holds its physical d
    order = gsg._K_ORDER.value if which == "K" else gsg._V_ORDER.value
    table = gsg._Q_PERM if which == "K" else gsg._O_PERM
    logical = _kernel_view(phys, order)
    assert sorted(table) == list(range(d))                     # a permutation
    assert torch.equal(logical, torch.tensor(table).repeat(gsg.TILE, 1))


@pytest.mark.parametrize("which", ["K", "V"])
def test_the_kernel_bit_formula_is_the_table(which: str) -> None:
    """``_physical_d`` in the kernel moves bit b of the logical index to position POS[b]; the host-side
    table it replaced (and that the other tests check) is ``physical_d``."""
    src = gsg._K_SRC if which == "K" else gsg._N_SRC
    pos = gsg.bit_positions(src)
    formula = [sum(((j >> b) & 1) << pos[b] for b in range(len(pos))) for j in range(gsg.HEAD_DIM)]
    assert formula == gsg.physical_d(src)


# The mma.sync B operand's layout for warps [1, 2], instruction [16, 8], k_width 2, as triton 3.6's
# gl.to_linear_layout prints it ([k, n] bases): K's operand is [d, token] = [256, 32], V's [token, d].
MMA_B = {
    "K": dict(regs=[[1, 0], [8, 0], [16, 0], [32, 0], [64, 0], [128, 0], [0, 16]],
              lanes=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], warps=[[0, 8]]),
    "V": dict(regs=[[1, 0], [8, 0], [16, 0], [0, 16], [0, 32], [0, 64], [0, 128]],
              lanes=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], warps=[[0, 8]]),
}


def _to_operand(basis: list[int], src: list, token_axis: int) -> list[int]:
    """A [token, byte] basis of the loaded bytes -> the [k, n] basis of the operand it lands on."""
    out = [0, 0]
    if basis[0]:
        out[token_axis] = basis[0]
    else:
        out[1 - token_axis] = 1 << src.index(("pb", basis[1].bit_length() - 1))
    return out


@pytest.mark.parametrize("which", ["K", "V"])
def test_the_byte_layouts_land_on_the_mma_fragments(which: str) -> None:
    """Through the logical order, the bytes' lane and warp bases are exactly the operand's, and their
    register bases plus the nibble's are its register bases (in another order: a renaming)."""
    if which == "K":
        src, regs, lanes, warps, token_axis = gsg._K_SRC, gsg._K_REGS, gsg._K_LANES, gsg._K_WARPS, 1
    else:
        src, regs, lanes, warps, token_axis = gsg._N_SRC, gsg._V_DEC_REGS, gsg._V_LANES, gsg._V_WARPS, 0
    want = MMA_B[which]
    nib = [0, 0]
    nib[1 - token_axis] = 1 << src.index(("nib",))
    assert [_to_operand(b, src, token_axis) for b in lanes] == want["lanes"]
    assert [_to_operand(b, src, token_axis) for b in warps] == want["warps"]
    got = [_to_operand(b, src, token_axis) for b in regs] + [nib]
    assert sorted(map(tuple, got)) == sorted(map(tuple, want["regs"]))
    # the decoder packs register-adjacent elements pairwise: its first register basis must be the
    # operand's k bit 0, so each packed fp16 pair is one fragment register
    assert _to_operand(regs[0], src, token_axis) == want["regs"][0]


def test_the_permuted_dot_is_the_dot() -> None:
    """QK over the logical order with q gathered by _Q_PERM equals QK in d order, and PV's logical
    columns land on d through _O_PERM: the algebra the kernel relies on, in float64."""
    gen = torch.Generator().manual_seed(7)
    d, n = gsg.HEAD_DIM, gsg.TILE
    q = torch.randn(12, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    p = torch.rand(12, n, generator=gen, dtype=torch.float64)
    k_log = _kernel_view(k, gsg._K_ORDER.value)
    q_log = q[:, torch.tensor(gsg._Q_PERM)]
    torch.testing.assert_close(q_log @ k_log.T, q @ k.T, rtol=1e-12, atol=1e-12)
    o_log = p @ _kernel_view(v, gsg._V_ORDER.value)
    o = torch.empty_like(o_log)
    o[:, torch.tensor(gsg._O_PERM)] = o_log                     # the kernel's store
    torch.testing.assert_close(o, p @ v, rtol=1e-12, atol=1e-12)


def _decode_case(kv: str):
    axes = dict(step="decode", batch=2, rows=2, context=256, kv_dtype=kv, act_dtype="bfloat16",
                q_heads=24, kv_heads=2, head_dim=256)
    return sparse_gqa_case(axes, torch.Generator().manual_seed(0), "cpu").inputs


def test_refuses_pages_other_than_nvfp4() -> None:
    case = _decode_case("fp8")
    with pytest.raises(ValueError, match="nvfp4 pages only"):
        gsg.gluon_decode(**case, out=torch.empty_like(case["q"]))


@pytest.mark.skipif(not triton_support.INTERPRETING, reason="the refusal is the interpreter's")
def test_refuses_the_interpreter_with_a_reason() -> None:
    case = _decode_case("nvfp4")
    with pytest.raises(ValueError, match="interpreter does not run Gluon"):
        gsg.gluon_decode(**case, out=torch.empty_like(case["q"]))


def test_compiles_for_sm90_with_free_operand_conversions(tmp_path) -> None:
    """Every ``convert_layout(..., assert_trivial=True)`` of the kernel is checked by the compiler:
    the decoded K and V tiles reach the tensor cores without a shared-memory round trip."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "tools/sm90_compile_check.py", "--op", "qsa_sparse_gqa",
                          "--sass"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert re.search(r"^OK\s+qsa_sparse_gqa::gluon_decode::decode_b8_8k_nvfp4", out.stdout, re.M), \
        out.stdout + out.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available() or triton_support.INTERPRETING,
                    reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("num_splits", [None, 64])
def test_padding_empty_rows_and_idle_splits_on_the_gpu(num_splits) -> None:
    """What decode_b8_8k_nvfp4 does not reach: a token list whose width is not a multiple of the
    32-token tile (a partial last tile), padding inside rows, a row with no token at all, and more
    splits than tiles (splits that only see padding). Band of the cell: 2 ulp, 1 eps."""
    from certify.harness.target import run_spec
    from certify.harness.oracles import tolerance
    from spec.ops.qsa import qsa_sparse_gqa

    axes = dict(step="decode", batch=6, rows=6, context=1500, kv_dtype="nvfp4", act_dtype="bfloat16",
                q_heads=24, kv_heads=2, head_dim=256)
    case = sparse_gqa_case(axes, torch.Generator().manual_seed(11), "cpu")
    gen = torch.Generator().manual_seed(12)
    tokens = case.inputs["tokens"].clone()
    drop = torch.rand(tokens.shape, generator=gen) < 0.5        # padding inside rows 1, 3, 4, 5
    drop[0] = False
    tokens[drop] = -1
    tokens = torch.cat([tokens, torch.full((tokens.shape[0], 5), -1, dtype=tokens.dtype)], 1)
    tokens[2] = -1                                              # a row that selects nothing
    assert tokens.shape[1] % gsg.TILE
    inputs = dict(case.inputs, tokens=tokens)
    ref = run_spec(qsa_sparse_gqa, type(case)(inputs, case.outputs), reference=True)["out"]

    def cuda(x):
        if isinstance(x, torch.Tensor):
            return x.cuda()
        if isinstance(x, tuple):
            return tuple(cuda(p) for p in x)
        if hasattr(x, "keywords"):                              # partial(nvfp4_load, gs=...)
            return type(x)(x.func, **{k: cuda(v) for k, v in x.keywords.items()})
        return x

    dev = {n: cuda(v) for n, v in inputs.items()}
    out = torch.full(dev["q"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    gsg.gluon_decode(**dev, out=out, num_splits=num_splits)
    out = out.cpu()
    assert not out.isnan().any()
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    v = tolerance("out", out, ref, 2, 1)
    assert v.passed, v.problems
