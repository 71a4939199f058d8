"""Receipts: the record of one certification, and the content hash that keeps it honest.

A receipt is fresh while its hash equals the hash of the code it certified today: the spec function's
module and the project modules it imports, the variant's, the input builder's, the cell and variant
entries, and the oracle. A content hash survives checkouts and rebases, where file times do not.
Library versions are recorded beside the hash (a GPU receipt made under another torch is still read on
the CPU), not inside it.

Files: ``<receipts dir>/<arch>.jsonl``, one JSON record a line, the latest record per
(op, variant, cell), sorted, so re-running a certification rewrites its line in place. A merge reads,
merges and rewrites a file under the directory's lock, and the rewrite is atomic (``certify.files.atomic``):
two runs writing at once each keep the other's receipts, and a full disk or a kill leaves the file as
it was.

A damaged line (not UTF-8, not JSON, a truncated record, a field missing or of the wrong type) is
skipped with a ``ReceiptProblem`` naming the file and the line; the other lines still load. A rewrite
of that file never loses it: a record that still names its target (op, variant, cell) stays as it is
until a new receipt of that target replaces it, as any receipt would be replaced (a run that
re-certifies one target leaves the unreadable records of the others in place); a line that names no
target (truncated, not JSON, not UTF-8) is left out of the rewritten file, so the file is valid again,
and its text is appended to ``<arch>.jsonl.damaged`` beside it, said on stderr, for a person to repair
or delete.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, model_serializer

from certify.files.atomic import atomic_write_bytes, locked
from certify.receipts.codehash import content_hash
from certify.harness.target import Outcome, seed_for
from certify.harness.requirements import versions as required_versions
from certify.catalog.schema import Cell, OpFile

class Receipt(BaseModel):
    model_config = ConfigDict(extra="ignore")

    op: str
    variant: str
    cell: str
    arch: str
    status: str
    metrics: dict[str, float] = {}
    message: str = ""
    hash: str
    versions: dict[str, str] = {}
    date: str
    seconds: float = 0.0
    seed: int | None = None     # the input builder's seed, ``seed_for(op, cell)``
    digests: dict[str, str] = {}  # output name -> ``tensor_digest`` of what the variant wrote
    # the harness checks that ran (``certify.harness.checks``): their code's hash, each check's
    # verdict and their seconds; empty for a receipt made before the checks existed
    harness: dict[str, Any] = {}

    @model_serializer(mode="wrap")
    def _without_empty_harness(self, handler):
        # a receipt made before the checks existed is written as it was read
        out = handler(self)
        if isinstance(out, dict) and not out.get("harness"):
            out.pop("harness", None)
        return out

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.op, self.variant, self.cell)


def library_versions() -> dict[str, str]:
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__} | cpu_dispatch()
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
        v["cuda"] = str(torch.version.cuda)
    return v


# The settings that choose which CPU kernels torch and oneDNN run (and so how fp32 sums round).
CPU_DISPATCH_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")


def cpu_dispatch() -> dict[str, str]:
    """The CPU kernels this process dispatches to: torch's capability (``AVX512``, ``AVX2``,
    ``DEFAULT``...), its intra-op thread count (a parallel reduction splits by threads), the processor
    (``cpu_model``), the settings of ``CPU_DISPATCH_SETTINGS`` that are set, and numpy's BLAS
    (``numpy_blas``). Two runs whose values agree here, with the same library versions, give the
    same bytes on the CPU."""
    import torch

    out = {"cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
           "threads": str(torch.get_num_threads())}
    model = cpu_model()
    if model:
        out["cpu_model"] = model
    out |= {k.lower(): os.environ[k] for k in CPU_DISPATCH_SETTINGS if os.environ.get(k)}
    blas = numpy_blas()
    if blas:
        out["numpy_blas"] = blas
    return out


@functools.cache
def cpu_model() -> str | None:
    """The processor as its vendor, family and model numbers, e.g. ``AuthenticAMD 25/17``: MKL,
    which torch's CPU GEMMs call, picks its kernels by vendor and microarchitecture, not only by
    instruction set, so an Intel and an AMD CPU that both report ``AVX512`` sum a GEMM's products in
    different orders (seen: 65 cpu receipts of an Intel AVX-512 machine gave other last bits on an
    AMD EPYC with AVX-512, every status and band unchanged). Linux's /proc/cpuinfo; None elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break                      # the first processor is enough
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        return None
    vendor = fields.get("vendor_id")
    if not vendor:
        return None
    return f"{vendor} {fields.get('cpu family', '?')}/{fields.get('model', '?')}"


@functools.cache
def numpy_blas() -> str | None:
    """numpy's BLAS library, its version and the CPU kernel family it picked at load, e.g.
    ``openblas 0.3.31.188.0 Haswell``. Triton's interpreter computes every ``tl.dot`` as a numpy
    matmul, and OpenBLAS's kernel families sum a dot's products in different orders: on one AVX-512
    CPU an interpreted chunked kernel gives other last bits under ``SkylakeX`` than under ``Haswell``
    (an Intel and an AMD machine pick these). Its thread count is left out: OpenBLAS splits a GEMM's
    rows and columns among threads, never a sum."""
    import numpy  # noqa: F401  (threadpoolctl lists the libraries already loaded)
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("user_api") == "blas" and "numpy" in lib.get("filepath", ""):
            return " ".join(str(lib.get(k) or "?") for k in ("internal_api", "version", "architecture"))
    return None


def make_receipt(op: OpFile, variant: str, cell: Cell, arch: str, outcome: Outcome,
                 harness: dict[str, Any] | None = None) -> Receipt:
    return Receipt(op=op.op, variant=variant, cell=cell.id, arch=arch, status=outcome.status,
                   metrics={k: round(v, 4) for k, v in outcome.metrics.items()},
                   message=outcome.message[:2000], hash=content_hash(op, variant, cell),
                   versions=library_versions() | required_versions(op.variant(variant)),
                   date=dt.date.today().isoformat(), seconds=round(outcome.seconds, 3),
                   seed=seed_for(op.op, cell.id), digests=dict(sorted(outcome.digests.items())),
                   harness=harness or {})


@dataclass(frozen=True)
class ReceiptProblem:
    """A line of a receipts file that does not load: skipped, named by file and line."""

    file: Path
    line: int
    message: str
    text: bytes  # the line as it is in the file
    key: tuple[str, str, str] | None = None  # the target it names, where it is a JSON record naming one

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


def _named_target(text: str) -> tuple[str, str, str] | None:
    """(op, variant, cell) of a JSON record that names them, though it is not a valid receipt."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    key = tuple(record.get(f) for f in ("op", "variant", "cell"))
    return key if all(isinstance(v, str) for v in key) else None


def _problem_message(e: ValidationError) -> str:
    errors = e.errors()
    parts = [f"{'.'.join(str(p) for p in err['loc']) or '(record)'}: {err['msg']}"
             for err in errors[:2]]
    more = f" (and {len(errors) - 2} more)" if len(errors) > 2 else ""
    return "not a receipt: " + "; ".join(parts) + more


def _read_book(path: Path) -> tuple[dict[tuple[str, str, str], Receipt], list[ReceiptProblem]]:
    """One receipts file: (op, variant, cell) -> latest receipt, and the lines that do not load."""
    book: dict[tuple[str, str, str], Receipt] = {}
    problems: list[ReceiptProblem] = []
    first_line: dict[tuple[str, str, str], tuple[int, bytes]] = {}
    twice: set[tuple[str, str, str]] = set()
    for n, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append(ReceiptProblem(path, n, f"not UTF-8: byte 0x{raw[e.start]:02x} at offset "
                                                    f"{e.start} of the line", raw))
            continue
        try:
            r = Receipt.model_validate_json(text)
        except ValidationError as e:
            problems.append(ReceiptProblem(path, n, _problem_message(e), raw, _named_target(text)))
            continue
        if r.key in first_line:
            # Two receipts of one target in one file: neither is evidence (which one is the claim?).
            m, first_raw = first_line[r.key]
            msg = f"the key {'::'.join(r.key)} appears twice (lines {m} and {n})"
            if r.key not in twice:
                problems.append(ReceiptProblem(path, m, msg, first_raw, r.key))
            problems.append(ReceiptProblem(path, n, msg, raw, r.key))
            twice.add(r.key)
            continue
        first_line[r.key] = (n, raw)
        book[r.key] = r
    for key in twice:
        del book[key]
    return book, problems


def load_receipts(receipts_dir: Path, problems: list[ReceiptProblem] | None = None
                  ) -> dict[str, dict[tuple[str, str, str], Receipt]]:
    """arch -> (op, variant, cell) -> latest receipt. Damaged lines are skipped: appended to
    ``problems`` when a list is given, else each said on stderr."""
    out: dict[str, dict[tuple[str, str, str], Receipt]] = {}
    for path in sorted(Path(receipts_dir).glob("*.jsonl")):
        book, bad = _read_book(path)
        out[path.stem] = book
        if problems is not None:
            problems.extend(bad)
            continue
        _warn_skipped(path, bad)
    return out


def _warn_skipped(path: Path, bad: list[ReceiptProblem], shown: int = 5) -> None:
    """Say on stderr which lines of ``path`` were skipped: the first few, then how many more."""
    for p in bad[:shown]:
        print(f"warning: {p} (line skipped)", file=sys.stderr)
    if len(bad) > shown:
        print(f"warning: {path}: {len(bad) - shown} more damaged line(s) skipped "
              "(`certify check` lists them all)", file=sys.stderr)


def _set_aside(path: Path, bad: list[ReceiptProblem]) -> None:
    """Append damaged lines of ``path`` to ``<path>.damaged`` before ``path`` is rewritten without
    them, and say so on stderr."""
    if not bad:
        return
    side = path.with_name(path.name + ".damaged")
    old = side.read_bytes() if side.is_file() else b""
    atomic_write_bytes(side, old + b"".join(p.text + b"\n" for p in bad))
    for p in bad:
        print(f"warning: {p}; the line is left out of the rewritten file and kept in {side}",
              file=sys.stderr)


def _rewrite(path: Path, book: dict[tuple[str, str, str], Receipt], bad: list[ReceiptProblem],
             written: set[tuple[str, str, str]], live=lambda key: True) -> None:
    """Rewrite ``path`` with ``book``, sorted by key. Of the file's damaged lines, one that names a
    live target (a JSON record with op, variant and cell: a field missing or invalid, e.g. written under
    another version of the receipt model, or a key repeated) stays as it is until a new receipt of that
    target (``written``) replaces it, as it replaces any receipt; the others (truncated, not JSON, not
    UTF-8, naming no target or a gone one) are set aside first, so a rewrite that fails after it
    duplicates them, never loses them."""
    stays = [p for p in bad if p.key is not None and p.key not in written and live(p.key)]
    superseded = [p for p in bad if p.key is not None and p.key in written]
    moved = [p for p in bad if not any(p is q for q in stays + superseded)]
    _set_aside(path, moved)
    rows = [(k, r.model_dump_json().encode()) for k, r in book.items()]
    rows += [(p.key, p.text) for p in stays]
    rows.sort(key=lambda row: row[0])  # stable: repeated damaged records keep their order
    atomic_write_bytes(path, b"".join(text + b"\n" for _, text in rows))


def write_receipts(receipts_dir: Path, new: list[Receipt]) -> None:
    """Merge new receipts into the per-arch files, keeping the latest per key, sorted: each file that
    gets a receipt is read, merged and rewritten under the directory's lock (``_rewrite`` says what
    happens to its damaged lines)."""
    receipts_dir = Path(receipts_dir)
    by_arch: dict[str, list[Receipt]] = {}
    for r in new:
        by_arch.setdefault(r.arch, []).append(r)
    with locked(receipts_dir):
        for arch, receipts in sorted(by_arch.items()):
            path = receipts_dir / f"{arch}.jsonl"
            book, bad = _read_book(path) if path.is_file() else ({}, [])
            for r in receipts:
                book[r.key] = r
            _rewrite(path, book, bad, written={r.key for r in receipts})


def prune_receipts(receipts_dir: Path, live: set[tuple[str, str, str, str]]) -> list[Receipt]:
    """Drop the receipts of targets that no longer exist (a cell, variant or arch removed from the
    cell files); ``live`` holds (arch, op, variant, cell) of every current target. Returns what was
    dropped. A receipt of a target that is gone certifies nothing and would stay in the files forever."""
    receipts_dir = Path(receipts_dir)
    dropped: list[Receipt] = []
    with locked(receipts_dir):
        for path in sorted(receipts_dir.glob("*.jsonl")):
            arch = path.stem
            book, bad = _read_book(path)
            keep = {k: r for k, r in book.items() if (arch, *k) in live}
            if len(keep) == len(book):
                _warn_skipped(path, bad)
                continue
            dropped += [r for k, r in book.items() if k not in keep]
            _rewrite(path, keep, bad, written=set(),
                     live=lambda key, arch=arch: (arch, *key) in live)
    return dropped


METRIC_SLACK = 1e-4  # metrics are recorded rounded to 4 decimals: a value at its band may round up


def evidence_problems(receipt: Receipt, op: OpFile, cell: Cell, arch: str) -> list[str]:
    """Why a receipt is no evidence of what it says, whatever its hash: its ``arch`` is not the file's,
    its versions cannot come from that arch, its seed is not the cell's, or a ``passed`` status that
    its digests, metrics and band do not bear out. Empty when it is consistent."""
    out: list[str] = []
    if receipt.arch != arch:
        out.append(f"arch {receipt.arch!r} in the {arch!r} file")
    torch_v = receipt.versions.get("torch", "")
    if arch.startswith("sm_"):
        if "+cpu" in torch_v or "cuda" not in receipt.versions or "gpu" not in receipt.versions:
            out.append(f"versions {receipt.versions} cannot come from {arch} (a CPU build of torch, "
                       "or no GPU recorded)")
    elif arch == "cpu-interpret" and "triton" not in receipt.versions:
        out.append("a cpu-interpret receipt without a triton version")
    if receipt.seed is None:
        out.append("no seed recorded")
    elif receipt.seed != seed_for(op.op, cell.id):
        out.append(f"seed {receipt.seed} is not the cell's {seed_for(op.op, cell.id)}")
    if receipt.status != "passed":
        return out
    if not receipt.digests:
        out.append("passed without a digest of any output")
    try:
        o = op.oracle_of(op.variant(receipt.variant), cell)
    except KeyError:
        return out + [f"variant {receipt.variant!r} is not in the op's file"]
    names = sorted(o.outputs) if o.kind == "tolerance" else sorted(receipt.digests)
    for name in names:
        if name not in receipt.digests:
            out.append(f"passed without a digest of output {name!r}")
        if o.kind == "tolerance":
            band = o.outputs[name]
            ulp, rms = receipt.metrics.get(f"{name}.ulp"), receipt.metrics.get(f"{name}.rel_rms")
            if ulp is None or rms is None:
                out.append(f"passed without the measured error of {name!r}")
            elif ulp > band.max_ulp + METRIC_SLACK or rms > band.max_rel_rms + METRIC_SLACK:
                out.append(f"passed, but {name!r} measured {ulp:g} ulp / {rms:g} eps against a band "
                           f"of {band.max_ulp:g} ulp / {band.max_rel_rms:g} eps")
        else:
            mism = receipt.metrics.get(f"{name}.mismatches")
            if mism is None:
                out.append(f"passed without the bitwise count of {name!r}")
            elif mism != 0:
                out.append(f"passed, but {name!r} has {mism:g} element(s) that differ")
    return out


UP_TO_DATE = ("certified", "expected failure")   # fresh statuses that ask for no new certification


def freshness(receipt: Receipt | None, op: OpFile, variant: str, cell: Cell,
              arch: str | None = None) -> str:
    """certified | expected failure | unexpected pass | failed | stale | invalid | not run: what a
    receipt says about the code as it is now (``invalid``: it is no evidence, see
    ``evidence_problems``; checked when ``arch`` is given). A fresh receipt of a (variant, arch) the
    cell declares to fail reads ``expected failure`` when it failed and ``unexpected pass`` when it
    passed."""
    if receipt is None:
        return "not run"
    if receipt.hash != content_hash(op, variant, cell):
        return "stale"
    if evidence_problems(receipt, op, cell, arch or receipt.arch):
        return "invalid"
    expected = cell.expected_failure(variant, arch or receipt.arch) is not None
    if receipt.status == "passed":
        return "unexpected pass" if expected else "certified"
    return "expected failure" if expected else "failed"
