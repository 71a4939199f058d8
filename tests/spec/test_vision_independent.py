"""The vision spec functions (spec/ops/vision.py) against formulations written independently from
docs/spec.md, "Vision input", on seeded inputs at the tiny geometry and on the catalog cells'
inputs.

- ``patchify``: pixel by pixel, frame f, patch row i, patch column j, then channel, pixel row, pixel
  column (step 1). Pure data movement: bitwise.
- ``vision_tower``: per frame, per patch, per head, per token in numpy float64 (steps 2 to 5): the
  embedding ``W_patch patch + pos_frame[f mod G] + pos_patch[i gw + j]``, each group of ``G`` whole
  frames run on its own, two pre-norm blocks of bidirectional softmax attention (scores of one head
  token by token, max subtracted, ``1 / sqrt(head_dim)``) and the ``gelu_tanh`` MLP from its formula
  ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``, the zero-centred rmsnorm
  ``x / sqrt(mean(x^2) + 1e-6) (1 + w)`` ("Norms and embeddings"), then the read-out.
- ``splice``: position by position with a running row counter (step 6): bitwise.
- ``frame_run``, ``frame_positions``: position by position (step 7), a running text position that
  jumps to ``s + max(F, gh, gw)`` after the run: integers, exact.
- ``mrope_sections``: ``(c, c, n - 2c)``, ``c = ceil(n / 3)``, ``n = rotary_dim / 2`` (step 7):
  exact.
- ``init_vision_weights``: not exempted. It draws seeded normals, but it also computes their scales
  from each projection's fan-in (its docstring: "projections of std 1/sqrt(fan_in), norms at 0";
  docs/spec.md says only that the norms are zero-centred), which a wrong fan-in breaks. Checked
  against that rule: the shapes the tower's prose implies for a VisionConfig, norm weights exactly 0
  (``1 + w`` = 1), each projection's sample std within 6 standard errors (``1 / sqrt(2N)`` of N
  samples) of ``fan_in^-1/2``, the same seed giving the same weights.

Tolerances. The tower's spec has a float64 path (float64 frames and weights make every step float64,
no rounding at the end), so it is compared with the float64 loop. Both evaluate the same real
function; they differ only in the order of their sums. A float64 sum of K products errs by at most
``K u sum|a b|`` (u = 2^-53, Higham, "Accuracy and Stability", 3.1); the longest sum has K = 192
terms (the patch embedding, 3 x 8 x 8, at 16 and at 32 pixels alike), so a step errs by
<= 192 u ~ 2.1e-14 of its operands' magnitude. A tower has about 31 such steps (embedding; per block
norm, qkv, scores, softmax, p v, W_o, residual, norm, W_up, gelu, W_down, residual; out norm,
read-out); with the weights at std ``fan_in^-1/2`` each stage has gain about 1, and we allow a
tenfold amplification across the chain (the residual sums, the 1/rms of the norms, softmax's exp of
scores of magnitude < 10; an allowance, not a proven bound). Two evaluations:
``2 x 31 x 10 x 192 u ~ 1.3e-11`` of the output's largest magnitude, so TOL64 = 2^-36 ~ 1.5e-11
(max abs difference over max |out|). Observed: ~1e-15. The fp32 path (fp32 inputs, fp32 out) is
checked too, the same way with u = 2^-24 and only its side erring: ``31 x 10 x 192 x 2^-24 ~
3.5e-3``, TOL32 = 2^-8 (a worst-case band: it catches a structural difference between the fp32 and
float64 paths, while the float64 comparison is the precise one; observed: ~5e-7). The bf16 path's
single rounding is certified by the cells' own oracle (certify/cells/vision_tower.yaml).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.harness.target import build_case
from spec.ops.vision import (VisionConfig, frame_positions, frame_run,
                             init_vision_weights, mrope_sections, patchify, splice, vision_tower)

pytestmark = pytest.mark.premerge

F64 = torch.float64
EPS = 1e-6                 # docs/spec.md, "Geometry": every epsilon is 1e-6
TOL64 = 2.0 ** -36
TOL32 = 2.0 ** -8
CFG = VisionConfig()       # the tiny geometry
WEIGHT_NAMES = ("patch_w", "pos_frame", "pos_patch", "attn_norm", "w_qkv", "w_o", "mlp_norm",
                "w_up", "w_down", "out_norm", "w_out")


# ---- second formulations -----------------------------------------------------------------------

def second_patches(frames: np.ndarray, p: int) -> list[list[float]]:
    """Step 1, pixel by pixel: one list per token, frames in order, patches in raster order."""
    F, C, H, W = frames.shape
    rows = []
    for f in range(F):
        for i in range(H // p):
            for j in range(W // p):
                rows.append([frames[f, c, p * i + r, p * j + s]
                             for c in range(C) for r in range(p) for s in range(p)])
    return rows


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / math.sqrt(float(np.mean(x * x)) + EPS) * (1.0 + w)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def second_tower(frames: np.ndarray, w: dict[str, np.ndarray], heads: int) -> np.ndarray:
    """Steps 2 to 5 in float64, group by group, token by token, head by head."""
    F, C, H, W = frames.shape
    D, K = w["patch_w"].shape
    p = int(round(math.sqrt(K / C)))
    gh, gw = H // p, W // p
    G = w["pos_frame"].shape[0]
    dh = D // heads
    patches = second_patches(frames, p)
    out = []
    for g in range(F // G):
        xs = []                                            # the group's tokens, in order
        for f in range(g * G, (g + 1) * G):
            for i in range(gh):
                for j in range(gw):
                    patch = np.array(patches[(f * gh + i) * gw + j])
                    xs.append(w["patch_w"] @ patch + w["pos_frame"][f % G]
                              + w["pos_patch"][i * gw + j])
        n = len(xs)
        for layer in range(w["attn_norm"].shape[0]):
            qkv = [w["w_qkv"][layer] @ _rms(x, w["attn_norm"][layer]) for x in xs]
            q = [v[:D] for v in qkv]
            k = [v[D:2 * D] for v in qkv]
            v = [v[2 * D:] for v in qkv]
            att = [np.zeros(D) for _ in range(n)]
            for hd in range(heads):
                sl = slice(hd * dh, (hd + 1) * dh)
                for a in range(n):
                    s = [float(np.dot(q[a][sl], k[b][sl])) / math.sqrt(dh) for b in range(n)]
                    m = max(s)
                    e = [math.exp(si - m) for si in s]
                    z = sum(e)
                    for b in range(n):
                        att[a][sl] += (e[b] / z) * v[b][sl]
            xs = [x + w["w_o"][layer] @ o for x, o in zip(xs, att)]
            xs = [x + w["w_down"][layer]
                  @ _gelu_tanh(w["w_up"][layer] @ _rms(x, w["mlp_norm"][layer])) for x in xs]
        out += [w["w_out"] @ _rms(x, w["out_norm"]) for x in xs]
    return np.stack(out)


def second_splice(embeds: list, rows: list, placeholder: list[bool]) -> list:
    out, r = [], 0
    for t, is_frame in enumerate(placeholder):
        if is_frame:
            out.append(rows[r])
            r += 1
        else:
            out.append(embeds[t])
    return out


def second_frame_run(placeholder: list[bool]):
    """(start, length), or None when the frame tokens do not form one run."""
    start, n, runs = 0, 0, 0
    for t, is_frame in enumerate(placeholder):
        if is_frame and (t == 0 or not placeholder[t - 1]):
            runs += 1
            start = t
        n += is_frame
    return None if runs > 1 else (start if n else 0, n)


def second_frame_positions(placeholder: list[bool], F: int, gh: int, gw: int) -> list[list[int]]:
    rows = [[], [], []]
    text = 0                 # the next text position
    s = None
    k = 0                    # the index of a frame token within the run
    for is_frame in placeholder:
        if is_frame:
            if s is None:
                s = text
            f, rest = divmod(k, gh * gw)
            i, j = divmod(rest, gw)
            for row, v in zip(rows, (s + f, s + i, s + j)):
                row.append(v)
            k += 1
            if k == F * gh * gw:
                text = s + max(F, gh, gw)
        else:
            for row in rows:
                row.append(text)
            text += 1
    return rows


def second_mrope_sections(rotary_dim: int):
    n = rotary_dim // 2
    c = math.ceil(n / 3)
    return (c, c, n - 2 * c) if n - 2 * c >= 1 else None


# ---- helpers -----------------------------------------------------------------------------------

def _seeded(seed: int, frames: int, frame_size: int = 16):
    gen = torch.Generator().manual_seed(seed)
    cfg = VisionConfig(frame_size=frame_size)
    w = init_vision_weights(cfg, gen, dtype=F64).as_dict()
    for name in ("attn_norm", "mlp_norm", "out_norm"):
        w[name] = 0.1 * torch.randn(w[name].shape, generator=gen, dtype=F64)
    x = torch.rand(frames, cfg.channels, cfg.frame_size, cfg.frame_size, generator=gen, dtype=F64)
    return 2 * x - 1, w


def _cell_inputs(cell: str):
    op = load_catalog(project_paths().cells).ops["vision_tower"]
    x = build_case(op, op.cell(cell), torch.device("cpu")).inputs
    return x["frames"].to(F64), {k: x[k].to(F64) for k in WEIGHT_NAMES}


def _rel_err(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.to(F64).numpy() - want)) / np.max(np.abs(want)))


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.second_formulation("spec.ops.vision:patchify")
@pytest.mark.parametrize("shape,p", [((3, 3, 16, 24), 8), ((2, 2, 6, 4), 2), ((1, 1, 4, 4), 4)])
def test_patchify_equals_pixel_by_pixel_gather(shape, p):
    gen = torch.Generator().manual_seed(sum(shape) + p)
    frames = torch.randn(shape, generator=gen, dtype=F64)   # H != W: a swapped row/column shows
    got = patchify(frames, p)
    want = torch.tensor(second_patches(frames.numpy(), p), dtype=F64)
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.second_formulation("spec.ops.vision:vision_tower")
@pytest.mark.parametrize("seed,frames,size", [(1, 2, 16), (2, 6, 16), (3, 2, 32)])
def test_tower_float64_equals_the_loop_on_seeded_inputs(seed, frames, size):
    x, w = _seeded(seed, frames, size)
    got = vision_tower(x, **w, heads=CFG.heads)
    want = second_tower(x.numpy(), {k: v.numpy() for k, v in w.items()}, CFG.heads)
    assert got.dtype == F64 and tuple(got.shape) == want.shape
    assert _rel_err(got, want) <= TOL64


@pytest.mark.second_formulation("spec.ops.vision:vision_tower")
@pytest.mark.parametrize("cell", ("one_group_16px", "four_groups_16px", "two_groups_32px"))
def test_tower_equals_the_loop_on_the_cells_inputs(cell):
    x, w = _cell_inputs(cell)
    want = second_tower(x.numpy(), {k: v.numpy() for k, v in w.items()}, CFG.heads)
    got = vision_tower(x, **w, heads=CFG.heads)
    assert got.dtype == F64 and _rel_err(got, want) <= TOL64
    got32 = vision_tower(x.float(), **{k: v.float() for k, v in w.items()}, heads=CFG.heads)
    assert got32.dtype == torch.float32 and _rel_err(got32, want) <= TOL32


@pytest.mark.second_formulation("spec.ops.vision:splice")
@pytest.mark.parametrize("mask", ["0011110", "1100", "0000", "0101", "111"])
def test_splice_equals_position_by_position_copy(mask):
    gen = torch.Generator().manual_seed(len(mask))
    ph = [c == "1" for c in mask]
    embeds = torch.randn(len(ph), 5, generator=gen, dtype=F64)
    rows = torch.randn(sum(ph), 5, generator=gen, dtype=F64)
    got = splice(embeds, rows, torch.tensor(ph))
    want = torch.stack(second_splice(list(embeds), list(rows), ph))
    assert torch.equal(got, want)
    assert got.data_ptr() != embeds.data_ptr()


def _masks():
    yield from (["0011100", "1110000", "0000111", "0000000", "1111111", "0100000"])
    gen = torch.Generator().manual_seed(9)
    for _ in range(40):
        T = int(torch.randint(1, 12, (1,), generator=gen))
        yield "".join("1" if b else "0" for b in torch.rand(T, generator=gen) < 0.4)


@pytest.mark.second_formulation("spec.ops.vision:frame_run")
def test_frame_run_equals_the_scan_and_refuses_two_runs():
    refused = 0
    for mask in _masks():
        ph = [c == "1" for c in mask]
        want = second_frame_run(ph)
        if want is None:
            refused += 1
            with pytest.raises(ValueError):
                frame_run(torch.tensor(ph))
        else:
            assert frame_run(torch.tensor(ph)) == want, mask
    assert refused > 0


@pytest.mark.second_formulation("spec.ops.vision:frame_positions")
@pytest.mark.parametrize("F,gh,gw",
                         [(2, 2, 2), (1, 2, 3), (3, 3, 2), (4, 1, 2), (2, 4, 4), (1, 1, 1)])
@pytest.mark.parametrize("before,after", [(0, 0), (3, 5), (0, 2), (4, 0)])
def test_frame_positions_equal_the_running_position_scan(F, gh, gw, before, after):
    ph = [False] * before + [True] * (F * gh * gw) + [False] * after
    got = frame_positions(torch.tensor(ph), F, gh, gw)
    assert got.dtype == torch.int64
    assert got.tolist() == second_frame_positions(ph, F, gh, gw)
    text = [False] * (before + after)                       # no frames: plain positions on all rows
    assert frame_positions(torch.tensor(text), 0, gh, gw).tolist() == \
        second_frame_positions(text, 0, gh, gw)


@pytest.mark.second_formulation("spec.ops.vision:mrope_sections")
def test_mrope_sections_follow_the_ceiling_rule():
    assert mrope_sections(64) == (11, 11, 10) and mrope_sections(16) == (3, 3, 2)   # the prose's
    for rotary_dim in range(2, 513, 2):
        want = second_mrope_sections(rotary_dim)
        if want is None:                                     # a section would be empty
            with pytest.raises(ValueError):
                mrope_sections(rotary_dim)
        else:
            assert mrope_sections(rotary_dim) == want, rotary_dim


@pytest.mark.second_formulation("spec.ops.vision:init_vision_weights")
def test_init_vision_weights_follow_the_fan_in_rule():
    cfg = VisionConfig(layers=3, width=96, heads=3, mlp=160, out_width=80, frame_size=24, patch=4)
    D, L, M, K = cfg.width, cfg.layers, cfg.mlp, cfg.channels * cfg.patch * cfg.patch
    fan_in = {"patch_w": ((D, K), K), "w_qkv": ((L, 3 * D, D), D), "w_o": ((L, D, D), D),
              "w_up": ((L, M, D), D), "w_down": ((L, D, M), M), "w_out": ((cfg.out_width, D), D)}
    w = init_vision_weights(cfg, torch.Generator().manual_seed(5), dtype=F64).as_dict()
    assert set(w) == set(WEIGHT_NAMES)
    for name, (shape, fan) in fan_in.items():
        t = w[name]
        assert tuple(t.shape) == shape and t.dtype == F64, name
        n = t.numel()
        assert abs(float(t.std()) * math.sqrt(fan) - 1) <= 6 / math.sqrt(2 * n), name
        assert abs(float(t.mean())) * math.sqrt(fan) <= 6 / math.sqrt(n), name
    for name, shape in (("attn_norm", (L, D)), ("mlp_norm", (L, D)), ("out_norm", (D,))):
        assert tuple(w[name].shape) == shape and not w[name].any(), name     # (1 + w) = 1
    grid = cfg.frame_size // cfg.patch
    assert tuple(w["pos_frame"].shape) == (cfg.group, D)
    assert tuple(w["pos_patch"].shape) == (grid * grid, D)
    for name in ("pos_frame", "pos_patch"):                 # small: well below a unit-std row
        assert 0 < float(w[name].std()) < 0.5, name
    again = init_vision_weights(cfg, torch.Generator().manual_seed(5), dtype=F64).as_dict()
    other = init_vision_weights(cfg, torch.Generator().manual_seed(6), dtype=F64).as_dict()
    assert all(torch.equal(w[k], again[k]) for k in w)
    assert not torch.equal(w["w_qkv"], other["w_qkv"])

