"""Receipts: the record of one certification, and the content hash that keeps it honest.

A receipt is fresh while its hash equals the hash of the code it certified today: the spec function's
module and the project modules it imports, the variant's, the input builder's, the cell and variant
entries, and the oracle. A content hash survives checkouts and rebases, where file times do not.
Library versions are recorded beside the hash (a GPU receipt made under another torch is still read on
the CPU), not inside it.

Files: ``<receipts dir>/<arch>.jsonl``, one JSON record a line, the latest record per
(op, variant, cell), sorted, so re-running a certification rewrites its line in place.
"""

from __future__ import annotations

import ast
import datetime as dt
import hashlib
import importlib.util
import json
import platform
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from certify.harness import Outcome
from certify.paths import project_paths
from certify.requirements import versions as required_versions
from certify.schema import Cell, OpFile

_FRAMEWORK_ORACLE_MODULES = ("certify.oracles", "certify.harness")


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

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.op, self.variant, self.cell)


@lru_cache(maxsize=None)
def _module_file(name: str) -> Path | None:
    top = name.partition(".")[0]
    if top != name and _module_file(top) is None:
        return None  # never import a third-party package just to locate one of its submodules
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    path = Path(spec.origin).resolve()
    root = project_paths().root.resolve()
    return path if root in path.parents and "site-packages" not in path.parts else None


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


@lru_cache(maxsize=None)
def module_closure(module: str) -> tuple[tuple[str, str], ...]:
    """(module, sha256 of its source) for a project module and every project module it imports."""
    seen: dict[str, str] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        todo.extend(_imports(path, name))
    return tuple(sorted(seen.items()))


def content_hash(op: OpFile, variant_name: str, cell: Cell) -> str:
    variant = op.variant(variant_name)
    h = hashlib.sha256()
    parts = {
        "spec": [op.spec, module_closure(op.spec.partition(":")[0])],
        "variant": [variant.model_dump(mode="json"),
                    module_closure(op.impl_path(variant).partition(":")[0])],
        "inputs": [op.inputs, module_closure(op.inputs.partition(":")[0])],
        "cell": cell.model_dump(mode="json"),
        "oracle": [module_closure(m) for m in _FRAMEWORK_ORACLE_MODULES],
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


def library_versions() -> dict[str, str]:
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
        v["cuda"] = str(torch.version.cuda)
    return v


def make_receipt(op: OpFile, variant: str, cell: Cell, arch: str, outcome: Outcome) -> Receipt:
    return Receipt(op=op.op, variant=variant, cell=cell.id, arch=arch, status=outcome.status,
                   metrics={k: round(v, 4) for k, v in outcome.metrics.items()},
                   message=outcome.message[:2000], hash=content_hash(op, variant, cell),
                   versions=library_versions() | required_versions(op.variant(variant)),
                   date=dt.date.today().isoformat(), seconds=round(outcome.seconds, 3))


def load_receipts(receipts_dir: Path) -> dict[str, dict[tuple[str, str, str], Receipt]]:
    """arch -> (op, variant, cell) -> latest receipt."""
    out: dict[str, dict[tuple[str, str, str], Receipt]] = {}
    for path in sorted(Path(receipts_dir).glob("*.jsonl")):
        book = out.setdefault(path.stem, {})
        for line in path.read_text().splitlines():
            if line.strip():
                r = Receipt.model_validate_json(line)
                book[r.key] = r
    return out


def write_receipts(receipts_dir: Path, new: list[Receipt]) -> None:
    """Merge new receipts into the per-arch files, keeping the latest per key, sorted."""
    receipts_dir = Path(receipts_dir)
    receipts_dir.mkdir(parents=True, exist_ok=True)
    books = load_receipts(receipts_dir)
    for r in new:
        books.setdefault(r.arch, {})[r.key] = r
    for arch, book in books.items():
        lines = [book[k].model_dump_json() for k in sorted(book)]
        (receipts_dir / f"{arch}.jsonl").write_text("\n".join(lines) + "\n")


def prune_receipts(receipts_dir: Path, live: set[tuple[str, str, str, str]]) -> list[Receipt]:
    """Drop the receipts of targets that no longer exist (a cell, variant or arch removed from the
    cell files); ``live`` holds (arch, op, variant, cell) of every current target. Returns what was
    dropped. A receipt of a target that is gone certifies nothing and would stay in the files forever."""
    receipts_dir = Path(receipts_dir)
    dropped: list[Receipt] = []
    for arch, book in load_receipts(receipts_dir).items():
        keep = {k: r for k, r in book.items() if (arch, *k) in live}
        if len(keep) == len(book):
            continue
        dropped += [r for k, r in book.items() if k not in keep]
        lines = [keep[k].model_dump_json() for k in sorted(keep)]
        (receipts_dir / f"{arch}.jsonl").write_text("\n".join(lines) + "\n" if lines else "")
    return dropped


def freshness(receipt: Receipt | None, op: OpFile, variant: str, cell: Cell) -> str:
    """certified | failed | stale | not run: what a receipt says about the code as it is now."""
    if receipt is None:
        return "not run"
    if receipt.hash != content_hash(op, variant, cell):
        return "stale"
    return "certified" if receipt.status == "passed" else "failed"
