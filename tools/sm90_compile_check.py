"""Compile every Triton kernel the sm_90 cells launch, for sm_90, on a machine without a GPU.

A kernel that runs in Triton's interpreter can still fail to compile for the GPU (make_ttgir, ptxas,
shared memory). This tool finds that before GPU time is spent: it installs a stand-in Triton driver
that reports an H200 (GPUTarget("cuda", 90, 32)) and launches nothing, then calls each variant's
wrapper on its cell's CPU-built inputs. Triton specialises and compiles each kernel exactly as a real
launch would (signature, constexprs, 16-byte pointer alignment, ints equal to 1 or divisible by 16),
through the real nvidia backend and its bundled ptxas; the launch itself is a no-op, so outputs are
garbage and only compilation is checked.

    python tools/sm90_compile_check.py [--triton-site DIR] [--op OP ...] [--any-arch]
                                       [--module-from MODULE=PATH ...] [-v] [--sass]

``--triton-site DIR`` puts DIR first on sys.path before triton is imported (the GPU's triton version,
see docs/gpu.md). ``--sass`` prints each new binary's registers, spills and SASS instruction mix.
Exit status 1 when any target fails to compile. See docs/gpu.md for the limits.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self


def _early_setup(argv: list[str]) -> None:
    """What must happen before anything imports triton: the site directory goes first on sys.path,
    and compile mode is forced (impl/kernels/triton_support.py only sets TRITON_INTERPRET=1 when the
    variable is unset, and Triton reads it when a kernel is decorated)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--triton-site")
    known, _ = pre.parse_known_args(argv)
    if known.triton_site:
        sys.path.insert(0, str(Path(known.triton_site).resolve()))
    os.environ["TRITON_INTERPRET"] = "0"
    root = Path(__file__).resolve().parent.parent  # the checkout: certify/, impl/, spec/
    if str(root) not in sys.path:
        sys.path.insert(1 if known.triton_site else 0, str(root))


if __name__ == "__main__":
    _early_setup(sys.argv[1:])

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver as _driver_config

from certify.catalog.load import load_catalog
from certify.harness.target import build_case, run_variant, variant_callable
from certify.files.paths import project_paths
from certify.catalog.plan import Target, targets

ARCH = "sm_90"
TARGET = GPUTarget("cuda", 90, 32)
# The H200's limits that Triton checks when it loads a binary (CompiledKernel._init_handles): a kernel
# over them fails on the GPU at its first launch, so it fails here too.
H200_PROPS: dict[str, int] = {"max_shared_mem": 232448, "max_num_regs": 65536, "multiprocessor_count": 132,
                              "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
                              "mem_bus_width": 6144}


# ---------------------------------------------------------------------------------------------------
# --sass: what the binary will do on the GPU, read without one
# ---------------------------------------------------------------------------------------------------

# SASS opcodes worth counting when a kernel is latency- or shared-memory-bound: global loads (LDG),
# cp.async (LDGSTS), shared loads and stores (LDS, STS, LDSM = ldmatrix, STSM = stmatrix), local
# memory (LDL / STL: register spills), tensor-core MMAs (HMMA: mma.sync; HGMMA: the warp-group
# wgmma), shuffles, barriers, byte permutes
# and packed conversions.
SASS_OPS = ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "STSM", "LDL", "STL", "HMMA", "HGMMA", "SHFL", "BAR",
            "PRMT", "F2FP")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-7T]\s+)?([A-Z][A-Z0-9]*)")


def _cuda_tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_summary(cubin: bytes) -> str:
    """Registers, stack and local bytes (cuobjdump --dump-resource-usage), the SASS instruction count
    and the count of each of ``SASS_OPS`` (nvdisasm), with the tools Triton bundles."""
    import subprocess
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_cuda_tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([_cuda_tool("nvdisasm"), "-c", f.name], capture_output=True,
                              text=True).stdout
    m = _RESOURCES.search(usage)
    res = (f"{m[1]} registers, stack {m[2]} B, local {m[4]} B" if m
           else "resources unreadable")
    ops = Counter(_OPCODE.findall(sass))
    mix = " ".join(f"{op} {ops[op]}" for op in SASS_OPS if ops[op])
    return f"{res}; {sum(ops.values())} SASS instructions: {mix}"


# ---------------------------------------------------------------------------------------------------
# The stand-in driver
# ---------------------------------------------------------------------------------------------------

@dataclass
class Recorder:
    """What the current target did: kernels compiled (or taken from Triton's in-process cache) and
    launched, and the kernel being compiled right now (set before compile, cleared after)."""

    launched: list[str] = field(default_factory=list)
    compiling: str | None = None
    sass: bool = False                 # --sass: read each new binary's resources and SASS mix
    loaded: list[str] = field(default_factory=list)   # one line per binary loaded for this target

    def reset(self) -> None:
        self.launched.clear()
        self.loaded.clear()
        self.compiling = None


RECORDER = Recorder()


class _NoLaunch:
    """The launcher Triton builds per compiled kernel: records the launch, runs nothing."""

    def __init__(self, src: Any, metadata: Any):
        self.name = getattr(src, "name", None) or getattr(metadata, "name", "?")

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        RECORDER.launched.append(self.name)


class _Utils:
    def get_device_properties(self, device: int) -> dict[str, int]:
        return dict(H200_PROPS)

    def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple:
        # (module, function, n_regs, n_spills, n_max_threads): a non-None module so Triton loads once;
        # 1024 threads per block, the H200's limit, so the num_warps check stays real.
        if RECORDER.sass:
            RECORDER.loaded.append(f"{name}: shared {shared} B, {sass_summary(kernel)}")
        return object(), 0, 0, 0, 1024

    def unload_module(self, module: Any) -> None:
        pass


class Sm90Driver(DriverBase):
    """A Triton driver for an H200 that is not there: target sm_90, device 0, stream 0."""

    def __init__(self) -> None:
        super().__init__()
        self.utils = _Utils()
        self.launcher_cls = _NoLaunch

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")  # where the inputs live; nothing runs on it

    def get_benchmarker(self) -> Callable:
        raise RuntimeError("sm90_compile_check launches nothing: no benchmarks")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_device_capability(self, device: int = 0) -> tuple[int, int]:
        return (9, 0)

    def get_device_interface(self) -> Any:
        raise RuntimeError("sm90_compile_check has no device interface")


def _before_compile(*, fn: Any, compile: dict, **_: Any) -> None:
    """Triton's jit_cache_hook, called just before a compile; its None return lets the compile go on."""
    RECORDER.compiling = f"{fn.name}({_constexprs(fn, compile)})"


def _constexprs(fn: Any, compile: dict) -> str:
    """The specialisation being compiled, by parameter name (Triton keys constants by argument path);
    best effort: the hook's payload is not a stable API."""
    try:
        names = fn.jit_function.arg_names
        consts = {names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k): v
                  for k, v in compile.get("constants", {}).items()}
        return ", ".join(f"{k}={v}" for k, v in consts.items())
    except Exception:  # noqa: BLE001
        return "?"


def _after_compile(**_: Any) -> None:
    RECORDER.compiling = None


def install_driver() -> None:
    """Make the stand-in the active (and default) driver and hook compilation; Triton must have been
    imported in compile mode (TRITON_INTERPRET=0)."""
    if triton.knobs.runtime.interpret:
        raise SystemExit("TRITON_INTERPRET is on: run this file as a script, or set TRITON_INTERPRET=0 "
                         "before anything imports triton")
    drv = Sm90Driver()
    _driver_config._default = drv  # reset_active() must not look for a real GPU driver
    _driver_config.set_active(drv)
    triton.knobs.runtime.jit_cache_hook = _before_compile
    triton.knobs.runtime.jit_post_compile_hook = _after_compile


# ---------------------------------------------------------------------------------------------------
# Checking targets
# ---------------------------------------------------------------------------------------------------

@dataclass
class Result:
    target: str          # op::variant::cell
    status: str          # OK | FAIL | NOT CHECKABLE
    kernels: list[str]   # kernels launched (in order, deduplicated)
    message: str = ""
    seconds: float = 0.0


class _CaptureStderr:
    """MLIR prints its diagnostics (the reason behind "PassManager::run failed") to file descriptor 2
    from C++, not into the exception: capture the descriptor around each target."""

    def __enter__(self) -> Self:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()


def _diagnostics(text: str, limit: int = 40) -> str:
    """The MLIR diagnostic lines (error: / note: with their locations); everything if none match."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if "error" in ln or "note:" in ln or ln.startswith("loc(")]
    chosen = keep or lines
    return "\n".join(chosen[:limit]) + (f"\n... ({len(chosen) - limit} more lines)" if len(chosen) > limit else "")


def _is_compile_error(exc: BaseException) -> bool:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    return RECORDER.compiling is not None or isinstance(exc, (CompilationError, OutOfResources))


def uses_triton(impl: Callable) -> bool:
    """Whether the variant's module holds Triton kernels or imports triton (torch-only variants have
    nothing to compile)."""
    from triton.runtime.jit import KernelInterface
    module = sys.modules.get(getattr(impl, "__module__", ""), None)
    if module is None:
        return False
    return any(isinstance(v, KernelInterface) or getattr(v, "__name__", "").split(".")[0] == "triton"
               for v in vars(module).values())


def check(t: Target) -> Result:
    """Call the variant on the cell's CPU inputs under the stand-in driver; classify what happened."""
    name = f"{t.op.op}::{t.variant.name}::{t.cell.id}"
    RECORDER.reset()
    start = time.perf_counter()
    status, message = "OK", ""
    with _CaptureStderr() as err:
        try:
            case = build_case(t.op, t.cell, torch.device("cpu"))
            run_variant(variant_callable(t.op, t.variant.name), case)
        except Exception as exc:  # noqa: BLE001  (every failure is reported, none stops the sweep)
            if _is_compile_error(exc):
                where = f"compiling {RECORDER.compiling}\n" if RECORDER.compiling else ""
                status, message = "FAIL", f"{where}{type(exc).__name__}: {str(exc).strip()}"
            else:
                tb = traceback.extract_tb(exc.__traceback__)[-1]
                status = "NOT CHECKABLE"
                message = (f"the wrapper failed on CPU inputs ({tb.filename}:{tb.lineno}): "
                           f"{type(exc).__name__}: {str(exc).strip()}")
    if status == "FAIL":
        diag = _diagnostics(err.text)
        message += f"\n{diag}" if diag else ""
    kernels = list(dict.fromkeys(RECORDER.launched))
    if status == "OK" and not kernels:
        status, message = "NOT CHECKABLE", "no Triton kernel was launched on CPU inputs"
    return Result(name, status, kernels, message, time.perf_counter() - start)


def sm90_targets(ops: list[str] | None, any_arch: bool) -> Iterator[Target]:
    """The (op, variant, cell) targets on sm_90 whose variant is Triton code. With ``any_arch``, Triton
    variants not (yet) declared for sm_90 too, over the cells of their own archs (to check a
    variant before it is declared for the GPU)."""
    cat = load_catalog(project_paths().cells)
    for problem in cat.errors:
        print(f"catalog: {problem}", file=sys.stderr)
    seen: set[tuple[str, str, str]] = set()
    for op in cat.ops.values():
        if ops and op.op not in ops:
            continue
        for t in targets(op):
            key = (op.op, t.variant.name, t.cell.id)
            if t.variant.impl == "spec" or key in seen or (t.arch != ARCH and not any_arch):
                continue
            if not uses_triton(variant_callable(op, t.variant.name)):
                continue
            seen.add(key)
            yield t


def load_module_from(spec: str) -> None:
    """``MODULE=PATH``: import PATH under MODULE's name before the catalog resolves its variants, so a
    scratch copy of a kernel module (an edit not yet in the tree) is checked in its place."""
    import importlib
    import importlib.util
    name, _, path = spec.partition("=")
    importlib.import_module(name.rpartition(".")[0])  # the parent package, as a normal import would
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise SystemExit(f"--module-from {spec}: cannot load {path}")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    mod_spec.loader.exec_module(module)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton-site", help="directory put first on sys.path before triton is imported")
    ap.add_argument("--op", action="append", help="only this op (repeatable)")
    ap.add_argument("--any-arch", action="store_true",
                    help="also Triton variants whose archs lack sm_90 (over their own cells)")
    ap.add_argument("--module-from", action="append", default=[], metavar="MODULE=PATH",
                    help="check the module file PATH in place of MODULE (repeatable)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the kernels of OK targets")
    ap.add_argument("--sass", action="store_true",
                    help="for each binary a target loads first: registers, stack and local (spill) "
                    "bytes, shared memory, and its SASS instruction mix (loads, stores, MMAs, ...)")
    args = ap.parse_args(argv)
    RECORDER.sass = args.sass
    install_driver()
    for spec in args.module_from:
        load_module_from(spec)
    print(f"triton {triton.__version__} ({Path(triton.__file__).parent}), torch {torch.__version__}, "
          f"target {TARGET}")
    results: list[Result] = []
    start = time.perf_counter()
    for t in sm90_targets(args.op, args.any_arch):
        r = check(t)
        results.append(r)
        detail = f"  [{', '.join(r.kernels)}]" if args.verbose and r.kernels else ""
        print(f"{r.status:<13} {r.target}  ({len(r.kernels)} kernels, {r.seconds:.1f}s){detail}", flush=True)
        if r.message:
            print("    " + r.message.replace("\n", "\n    "), flush=True)
        for line in RECORDER.loaded:
            print("    " + line, flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("OK", "FAIL", "NOT CHECKABLE")}
    print(f"{len(results)} targets: {counts['OK']} OK, {counts['FAIL']} FAIL, "
          f"{counts['NOT CHECKABLE']} not checkable ({time.perf_counter() - start:.0f}s)")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
