"""The adversarial checks of one certification: what a variant does besides writing its outputs.

The certifying call itself is observed (``Probe`` wraps the variant that ``certify_cell`` calls):
- ``inputs_untouched``: every input not declared in place (``Case.inplace``) has the same bytes after
  the call as before;
- ``canary``: every output and in-place buffer is handed over as a view into a larger buffer whose
  bytes before and after it hold a canary pattern; the canary must be intact after the call;
- ``inplace_unowned_rows``: the dim-0 rows of an in-place buffer that the spec leaves unchanged (rows
  the call does not own) keep their bytes.
Then the variant is called again (``second_call`` and friends):
- ``dirty_reuse``: a second call into the first call's output buffers, which still hold its results,
  on fresh copies of the inputs, gives the same bytes;
- ``views``: inputs the op's contract admits as views (``harness.views``) are handed over as
  non-contiguous views at an offset; the outputs must be the same bytes;
- ``cuda_graph``: on a CUDA device, a replay of the call captured in a CUDA graph gives the same bytes
  as the eager call.
A verdict is ``passed``, ``failed: <why>`` or ``not run: <why>``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from certify.harness import oracles
from certify.harness.target import Case, SpecVariant

PASSED = "passed"
CANARY_BYTE = 0xA5
CANARY_BYTES = 256   # the canary before and after each buffer; a multiple of 128 keeps alignment


def not_run(why: str) -> str:
    return f"not run: {why}"


def failed(why: str) -> str:
    return f"failed: {why}"


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for e in x for t in _tensors(e)]
    return []


def clone(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(clone(e) for e in x)
    return x.clone() if isinstance(x, torch.Tensor) else x


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Where two tensors' bytes first differ, as 'k of n element(s) differ, first at (i, j)', or
    None when they are the same bytes (shape and dtype included)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    diff = oracles.bit_pattern(got.detach().cpu()) != oracles.bit_pattern(want.detach().cpu())
    if not diff.any():
        return None
    first = tuple(int(i) for i in diff.nonzero()[0])
    return f"{int(diff.sum())} of {diff.numel()} element(s) differ, first at {first}"


def same_bytes(got: Any, want: Any, name: str) -> str | None:
    """The first difference between two tensors or sequences of tensors, naming ``name``."""
    a, b = _tensors(got), _tensors(want)
    for i, (x, y) in enumerate(zip(a, b)):
        d = first_difference(x, y)
        if d:
            return f"{name}{f'[{i}]' if len(a) > 1 else ''}: {d}"
    return None


class _Guarded:
    """A tensor's copy inside a larger buffer whose bytes before and after it hold the canary."""

    def __init__(self, t: torch.Tensor):
        size = t.element_size()
        self.pad = max(1, CANARY_BYTES // size)
        self.numel = t.numel()
        self.base = torch.empty(self.pad * 2 + self.numel, dtype=t.dtype, device=t.device)
        self.base.view(torch.uint8).fill_(CANARY_BYTE)
        self.view = self.base[self.pad:self.pad + self.numel].view(t.shape)
        self.view.copy_(t)

    def canary_problem(self, name: str) -> str | None:
        raw = self.base.view(torch.uint8)
        size = self.base.element_size()
        head, tail = raw[: self.pad * size], raw[(self.pad + self.numel) * size:]
        before = (head != CANARY_BYTE).nonzero()
        if before.numel():
            k = self.pad - int(before[-1]) // size
            return f"{name}: canary before the start written, first at flat index -{k}"
        past = (tail != CANARY_BYTE).nonzero()
        if past.numel():
            k = int(past[0]) // size
            return (f"{name}: canary past the end written, first at flat index {self.numel + k} "
                    f"(the buffer holds {self.numel})")
        return None


def _guard(x: Any) -> tuple[Any, list[_Guarded]]:
    if isinstance(x, torch.Tensor):
        g = _Guarded(x)
        return g.view, [g]
    if isinstance(x, (tuple, list)):
        parts = [_guard(e) for e in x]
        return type(x)(p[0] for p in parts), [g for p in parts for g in p[1]]
    return x, []


def _copy_back(dst: Any, src: Any) -> None:
    for d, s in zip(_tensors(dst), _tensors(src)):
        d.copy_(s)


def prepare(impl: Callable, case: Case) -> None:
    """Tell the spec's own path (``impl: spec``) the case's outputs, as ``run_variant`` does."""
    if isinstance(impl, SpecVariant):
        impl.outputs = list(case.outputs)
        impl.inplace = dict(case.inplace)


def call(impl: Callable, case: Case, inputs: dict[str, Any],
         outs: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Call the variant on ``inputs`` (used as given: pass copies) into ``outs`` (default: fresh
    poisoned buffers, copied into guarded ones); return every output, the in-place ones as the
    updated inputs."""
    prepare(impl, case)
    if outs is None:
        device = next((t.device for v in inputs.values() for t in _tensors(v)), "cpu")
        outs = {n: oracles.poison(torch.empty(s.shape, dtype=s.dtype, device=device))
                for n, s in case.outputs.items() if n not in case.inplace}
    # inside guarded buffers as in the certifying call, so that a stray write lands in a canary
    outs = {n: _guard(t)[0] for n, t in outs.items()}
    impl(**inputs, **outs)
    got = dict(outs)
    for out_name, in_name in case.inplace.items():
        got[out_name] = inputs[in_name]
    return got


class Probe:
    """Wraps a variant for its certifying call (``certify_cell(..., impl_override=probe)``): records
    the inputs before the call, hands the outputs and in-place buffers over inside canary-guarded
    buffers, checks the canaries and the untouched inputs after it, and copies the results back into
    the buffers ``certify_cell`` gave, so its oracle judges the same bytes. Only the first call is
    observed."""

    def __init__(self, impl: Callable, case: Case):
        self.impl = impl
        self.case = case
        self.before: dict[str, Any] | None = None   # every input as it was before the call
        self.first: dict[str, Any] | None = None    # every output of the call
        self.verdicts: dict[str, str] = {}

    def __call__(self, **kw: Any) -> None:
        if self.before is not None:
            self.impl(**kw)
            return
        prepare(self.impl, self.case)
        inplace_inputs = set(self.case.inplace.values())
        self.before = {n: clone(kw[n]) for n in self.case.inputs}
        handed, guards = dict(kw), {}
        for name in [*[n for n in self.case.outputs if n not in self.case.inplace],
                     *sorted(inplace_inputs)]:
            handed[name], guards[name] = _guard(kw[name])
        self.impl(**handed)
        canary = [p for n, gs in guards.items() for g in gs if (p := g.canary_problem(n))]
        self.verdicts["canary"] = failed("; ".join(canary)) if canary else PASSED
        for name in guards:
            _copy_back(kw[name], handed[name])
        touched = [p for n in self.case.inputs if n not in inplace_inputs
                   if (p := same_bytes(kw[n], self.before[n], f"input {n}"))]
        self.verdicts["inputs_untouched"] = (failed("; ".join(touched)) if touched else PASSED) \
            if self.case.inputs else not_run("the op has no input")
        self.first = {n: clone(kw[n]) for n in self.case.outputs if n not in self.case.inplace}
        self.first |= {o: clone(kw[i]) for o, i in self.case.inplace.items()}

    def fresh_inputs(self) -> dict[str, Any]:
        return {n: clone(v) for n, v in self.before.items()}


def unowned_rows(probe: Probe, spec_result: dict[str, Any] | None, why_not: str | None) -> str:
    """The dim-0 rows of each in-place buffer that the spec leaves as they were must keep their
    bytes in the variant's result."""
    case = probe.case
    if not case.inplace:
        return not_run("the op updates no buffer in place")
    if why_not:
        return not_run(why_not)
    problems = []
    for out_name, in_name in case.inplace.items():
        for i, (orig, ref, got) in enumerate(zip(_tensors(probe.before[in_name]),
                                                 _tensors(spec_result[out_name]),
                                                 _tensors(probe.first[out_name]))):
            if orig.dim() == 0 or ref.shape != orig.shape:
                continue
            flat = lambda t: oracles.bit_pattern(t.detach().cpu()).reshape(t.shape[0], -1)  # noqa: E731
            owned = (flat(ref) != flat(orig)).any(dim=1)
            changed = (flat(got) != flat(orig)).any(dim=1)
            bad = (changed & ~owned).nonzero()
            if bad.numel():
                part = f"[{i}]" if len(_tensors(orig)) > 1 else ""
                problems.append(f"in-place {in_name}{part}: {int(bad.numel())} row(s) the call does "
                                f"not own written, first at ({int(bad[0])},)")
    return failed("; ".join(problems)) if problems else PASSED


def dirty_reuse(probe: Probe) -> str:
    """A second call into the first call's output buffers, still holding its results."""
    got = call(probe.impl, probe.case, probe.fresh_inputs(),
               {n: clone(t) for n, t in probe.first.items() if n not in probe.case.inplace})
    problems = [p for n in probe.case.outputs if (p := same_bytes(got[n], probe.first[n],
                                                                  f"output {n}"))]
    return failed("the second call into dirty buffers differs: " + "; ".join(problems)) \
        if problems else PASSED


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view that is neither contiguous nor at offset 0 of its storage."""
    if t.dim() == 0 or t.numel() == 0:
        return t.clone()
    big = torch.empty(*t.shape[:-1], t.shape[-1] * 2 + 1, dtype=t.dtype, device=t.device)
    v = big[..., 1::2]
    v.copy_(t)
    return v


def _viewable(x: Any) -> bool:
    return any(t.dim() > 0 and t.numel() > 1 for t in _tensors(x))


def _as_views(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_as_views(e) for e in x)
    return _strided(x) if isinstance(x, torch.Tensor) else x


def views(probe: Probe, admitted: tuple[str, ...]) -> str:
    """Non-contiguous, offset views of the inputs. Those the contract admits (``harness.views``)
    must be taken and give the first call's bytes. The other inputs (not updated in place) are
    handed as views in one more call, which the variant must refuse by raising, or honour: a
    result of other bytes is a kernel that reads a view as if it were contiguous."""
    case = probe.case
    unknown = [n for n in admitted if n not in case.inputs]
    if unknown:
        return failed(f"harness.views names {unknown}, not inputs of the case {sorted(case.inputs)}")
    verdicts = []
    if admitted:
        inputs = probe.fresh_inputs() | {n: _as_views(probe.before[n]) for n in admitted}
        try:
            got = call(probe.impl, case, inputs)
        except Exception as e:  # noqa: BLE001 - a refusal of an admitted view is the check's failure
            return failed(f"views of {list(admitted)} refused: {type(e).__name__}: {e}")
        problems = [p for n in case.outputs
                    if (p := same_bytes(got[n], probe.first[n], f"output {n}"))]
        if problems:
            return failed(f"non-contiguous, offset views of {list(admitted)} give other bytes: "
                          + "; ".join(problems))
        verdicts.append(f"takes views of {', '.join(admitted)}")
    others = [n for n in case.inputs if n not in admitted and n not in case.inplace.values()
              and _viewable(probe.before[n])]
    refused, honoured, problems = {}, [], []
    # All of them in one call; where that is refused, each alone, so that an input read as
    # contiguous is not hidden behind another input's refusal. A refusal costs no launch.
    for names in [others] + ([[n] for n in others] if len(others) > 1 else []):
        inputs = probe.fresh_inputs() | {n: _as_views(probe.before[n]) for n in names}
        try:
            got = call(probe.impl, case, inputs)
        except Exception as e:  # noqa: BLE001 - a refusal is what the contract asks for
            if len(names) == 1:
                refused[names[0]] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            continue
        bad = [p for n in case.outputs if (p := same_bytes(got[n], probe.first[n], f"output {n}"))]
        if bad:
            problems.append(f"views of {names}: " + "; ".join(bad))
        else:
            honoured += names
        if names is others:
            break  # honoured (or misread) all at once: nothing to single out
    if problems:
        return failed("non-contiguous, offset views the contract does not admit were neither "
                      "refused nor honoured: " + " | ".join(problems))
    if honoured:
        verdicts.append(f"honours views of {', '.join(honoured)}")
    if refused:
        first = next(iter(refused.values()))
        verdicts.append(f"refuses views of {', '.join(refused)} (e.g. {first})")
    if not verdicts:
        return not_run("the call has no input of more than one element")
    return f"{PASSED}: {'; '.join(verdicts)}"


def cuda_graph(probe: Probe) -> str:
    """A CUDA-graph replay of the call against the eager call's bytes (CUDA devices only)."""
    case = probe.case
    device = next((t.device for v in probe.before.values() for t in _tensors(v)), None)
    if device is None or device.type != "cuda":
        return not_run("a CUDA-graph replay needs a CUDA device")
    inputs = probe.fresh_inputs()
    outs = {n: oracles.poison(torch.empty(s.shape, dtype=s.dtype, device=device))
            for n, s in case.outputs.items() if n not in case.inplace}
    prepare(probe.impl, case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # The warm-up compiles and autotunes outside the capture. It also runs with synchronising calls
    # raising: a call that waits on the host cannot be captured, and a capture that fails on one
    # can leave the device unusable for the targets after it.
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            probe.impl(**inputs, **outs)
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return not_run(f"the call synchronises with the host: {str(e).splitlines()[0]}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            probe.impl(**inputs, **outs)
    except Exception as e:  # noqa: BLE001 - a variant the engine never captures may refuse
        return not_run(f"the call cannot be captured: {type(e).__name__}: {e}")
    _copy_back([inputs[n] for n in case.inputs], [probe.before[n] for n in case.inputs])
    for t in outs.values():
        oracles.poison(t)
    graph.replay()
    torch.cuda.synchronize()
    got = dict(outs) | {o: inputs[i] for o, i in case.inplace.items()}
    problems = [p for n in case.outputs if (p := same_bytes(got[n], probe.first[n], f"output {n}"))]
    return failed("the graph replay differs from the eager call: " + "; ".join(problems)) \
        if problems else PASSED
