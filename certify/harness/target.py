"""Certify one (op, variant, cell, arch): build seeded inputs, run the spec and the variant, apply the
oracle. The pytest items, ``certify run`` and the framework's own tests all go through ``certify_cell``.

Contracts a target's modules follow (see the cell file of any op):
- the input builder ``build(axes, gen, device) -> Case``: seeded from (op, cell), never all zeros;
- the spec function ``spec(**inputs) -> dict[name, Tensor]`` (pure, float64-capable);
- a variant ``impl(**inputs, **outputs) -> None`` writes every declared output into the buffers it is
  given (poisoned first), and updates the inputs named in ``Case.inplace`` in place.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from certify.harness import oracles
from certify.harness.archs import device_for
from certify.catalog.schema import EXACT, Cell, OpFile, Oracle


@dataclass
class OutSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Case:
    """Inputs of one cell and the outputs a variant must write."""

    inputs: dict[str, Any]
    outputs: dict[str, OutSpec]
    inplace: dict[str, str] = field(default_factory=dict)  # output name -> input it updates in place


@dataclass
class Outcome:
    status: str  # passed | failed | error
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""
    seconds: float = 0.0
    ran: dict[str, bool] = field(default_factory=dict)  # spec / variant / oracle actually ran
    digests: dict[str, str] = field(default_factory=dict)  # output name -> tensor_digest


def tensor_digest(x: torch.Tensor | tuple | list) -> str:
    """sha256 of a tensor's dtype, shape and bytes (row-major), or of a sequence of tensors (a
    multi-pool output) in order: equal digests, equal results."""
    h = hashlib.sha256()
    for t in (x if isinstance(x, (tuple, list)) else (x,)):
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def certifying_problem(name: str, outcome: Outcome) -> str | None:
    """Why a passed certification certifies nothing: the variant, the spec (or its named stand-in) and
    the oracle must all have run. None when all three ran."""
    missing = [k for k in ("variant", "spec", "oracle") if not outcome.ran.get(k)]
    return f"{name}: passed without running {missing}" if missing else None


def resolve(path: str) -> Callable:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class SpecVariant:
    """The spec's low-precision path in the variant calling convention (``impl: spec``): the spec runs
    in the inputs' own dtypes and each result is copied into its poisoned output buffer.
    ``run_variant`` tells it the output names of the case at hand."""

    def __init__(self, spec: Callable):
        self.spec = spec
        self.outputs: list[str] = []
        self.inplace: dict[str, str] = {}

    def __call__(self, **kwargs: Any) -> None:
        bufs = {n: kwargs.pop(n) for n in self.outputs if n in kwargs and n not in self.inplace}
        res = self.spec(**kwargs)
        if isinstance(res, tuple):
            res = dict(zip(self.outputs, _flat(res)))
        elif not isinstance(res, dict):
            res = {self.outputs[0]: res}
        for name, buf in bufs.items():
            buf.copy_(res[name])
        # An in-place output: the spec returns the new value, the convention updates the input.
        for out_name, in_name in self.inplace.items():
            kwargs[in_name].copy_(res[out_name])


def variant_callable(op: OpFile, variant_name: str) -> Callable:
    variant = op.variant(variant_name)
    return SpecVariant(resolve(op.spec_of(variant))) if variant.impl == "spec" else \
        resolve(variant.impl)


def seed_for(op: str, cell_id: str) -> int:
    """A stable 63-bit seed from (op, cell): a failure reproduces from its name alone."""
    return int.from_bytes(hashlib.sha256(f"{op}/{cell_id}".encode()).digest()[:8], "big") >> 1


def build_case(op: OpFile, cell: Cell, device: torch.device) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(seed_for(op.op, cell.id))
    case: Case = resolve(op.inputs)(op.axes_of(cell), gen, device)
    return case


def _clone(x: Any) -> Any:
    if isinstance(x, (tuple, list)):  # a multi-tensor input (e.g. a cache of several pools)
        return type(x)(_clone(e) for e in x)
    return x.clone() if isinstance(x, torch.Tensor) else x


def _to64(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_to64(e) for e in x)
    # A floating dtype narrower than 16 bits (e4m3, e5m2, ...) holds storage codes, not activations:
    # its values are exact in any wider dtype, so widening adds no precision, and it would erase the
    # dtype the spec's decoder (a dequantising load) checks. The reference reads such codes as stored.
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.dtype.itemsize >= 2:
        return x.detach().to(torch.float64)
    return _clone(x)


def _flat(res: tuple) -> list:
    """A spec's tuple result with nested tuples (a multi-pool result) flattened in order: the
    elements name Case.outputs one by one."""
    out: list = []
    for r in res:
        out += _flat(r) if isinstance(r, (tuple, list)) else [r]
    return out


def run_variant(impl: Callable, case: Case) -> dict[str, torch.Tensor]:
    """Call a variant on fresh copies of the inputs with poisoned output buffers; return its outputs."""
    if isinstance(impl, SpecVariant):
        impl.outputs = list(case.outputs)
        impl.inplace = dict(case.inplace)
    inputs = {k: _clone(v) for k, v in case.inputs.items()}
    device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), "cpu")
    outs = {name: oracles.poison(torch.empty(spec.shape, dtype=spec.dtype, device=device))
            for name, spec in case.outputs.items() if name not in case.inplace}
    impl(**inputs, **outs)
    for out_name, in_name in case.inplace.items():
        outs[out_name] = inputs[in_name]
    return outs


def run_spec(spec: Callable, case: Case, reference: bool) -> dict[str, torch.Tensor]:
    conv = _to64 if reference else _clone
    res = spec(**{k: conv(v) for k, v in case.inputs.items()})
    if isinstance(res, dict):
        return res
    if isinstance(res, tuple):  # a spec returning a tuple names its results in Case.outputs order
        return dict(zip(case.outputs, _flat(res)))
    return {next(iter(case.outputs), "out"): res}


def certify_cell(op: OpFile, variant_name: str, cell: Cell, arch: str,
                 impl_override: Callable | None = None) -> Outcome:
    """Certify one variant at one cell on one arch. Never raises: errors become an 'error' outcome."""
    t0 = time.perf_counter()
    ran = {"spec": False, "variant": False, "oracle": False}
    try:
        variant = op.variant(variant_name)  # an unknown variant becomes an error outcome
        if arch == "cpu-interpret":
            # Triton reads this when a kernel is decorated, so it must be set before the import.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        impl = impl_override or variant_callable(op, variant_name)
        spec = resolve(op.spec_of(variant))
        case = build_case(op, cell, device_for(arch))
        got = run_variant(impl, case)
        ran["variant"] = True
        digests = {name: tensor_digest(t) for name, t in got.items()}
        verdicts = _apply_oracle(op, op.oracle_of(variant, cell), spec, impl, case, got, ran)
        metrics: dict[str, float] = {}
        if variant.numerics != EXACT:
            metrics |= exact_errors(resolve(op.spec), case, got)
        problems: list[str] = []
        for v in verdicts:
            metrics.update(v.metrics)
            problems += v.problems
        status = "passed" if not problems else "failed"
        return Outcome(status, metrics, "\n".join(problems), time.perf_counter() - t0, ran, digests)
    except Exception as e:  # noqa: BLE001 - a crash in one cell must not stop the others
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return Outcome("error", {}, f"{tb}\n{traceback.format_exc(limit=-3)}",
                       time.perf_counter() - t0, ran)


def exact_errors(spec: Callable, case: Case, got: dict[str, torch.Tensor]) -> dict[str, float]:
    """A tier variant's error against the exact spec's float64 result, recorded beside its verdict
    (``exact.<output>.ulp`` and ``.rel_rms``, the tolerance oracle's units), never judged: what its
    tier costs against float64."""
    ref = run_spec(spec, case, reference=True)
    out: dict[str, float] = {}
    for name, t in got.items():
        if name in ref and t.dtype.is_floating_point:
            v = oracles.tolerance(name, t.cpu(), ref[name].cpu(), math.inf, math.inf)
            out |= {f"exact.{k}": x for k, x in v.metrics.items()}
    return out


def _apply_oracle(op: OpFile, o: Oracle, spec: Callable, impl: Callable, case: Case,
                  got: dict[str, torch.Tensor], ran: dict[str, bool]) -> list[oracles.Verdict]:
    verdicts: list[oracles.Verdict] = []
    missing = set(case.outputs) - set(got)
    if missing:
        return [oracles.Verdict(False, problems=[f"outputs never produced: {sorted(missing)}"])]
    if o.kind == "tolerance":
        ref = run_spec(spec, case, reference=True)
        ran["spec"] = True
        unknown = set(o.outputs) - set(case.outputs)
        if unknown or set(case.outputs) - set(o.outputs):
            return [oracles.Verdict(False, problems=[
                f"the oracle's bands {sorted(o.outputs)} must name exactly the outputs "
                f"{sorted(case.outputs)}"])]
        for name, band in o.outputs.items():
            verdicts.append(oracles.tolerance(name, got[name].cpu(), ref[name].cpu(), band.max_ulp,
                                              band.max_rel_rms, band.allow_matching_inf))
        ran["oracle"] = True
        return verdicts
    # Bitwise: against the spec in the same dtypes (its own rounding points), or another variant.
    if o.against == "spec":
        ref = run_spec(spec, case, reference=False)
        ran["spec"] = True
    elif o.against == "spec64":
        # float64 plus rounding: the ideal result rounded once to each output's dtype.
        ideal = run_spec(spec, case, reference=True)
        ref = {n: (oracles.round_once(ideal[n], got[n].dtype) if ideal[n].dtype.is_floating_point
                   else ideal[n]) for n in case.outputs}
        ran["spec"] = True
    else:
        ref = run_variant(variant_callable(op, o.against.split(":", 1)[1]), case)
        ran["spec"] = True  # the named reference ran in the spec's place
    for name in case.outputs:
        v = oracles.bitwise(name, got[name].cpu(), ref[name].cpu(), o.signed_zero_equal)
        if not v.passed and got[name].dtype.is_floating_point:
            try:
                ref64 = run_spec(spec, case, reference=True)[name].cpu()
            except Exception as e:  # noqa: BLE001 - a case whose spec has no float64 form (storage
                # in a narrow dtype the widening would change) still reports its bitwise failure
                v.problems.append(f"{name}: no float64 comparison ({type(e).__name__}: {e})")
                verdicts.append(v)
                continue
            who, e_got, e_ref = oracles.closer_to_float64(got[name].cpu(), ref[name].cpu(), ref64)
            side = {"a": "the variant", "b": f"the reference ({o.against})", "tie": "neither"}[who]
            v.problems.append(f"{name}: closer to float64: {side} (rms error {e_got:.3g} vs "
                              f"{e_ref:.3g})")
        verdicts.append(v)
    ran["oracle"] = True
    return verdicts
