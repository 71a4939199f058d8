"""``certify merge``: fold receipt files written elsewhere (one per worker, a machine of a fleet)
into the receipts directory, idempotently, without ever resolving a disagreement silently.

Per target (arch, op, variant, cell), an incoming receipt against what the directory holds, and
against the other incoming ones:

- the same content hash and the same output digests: one certification, seen twice. It collapses
  (the directory keeps what it has: merging the same files again changes no byte);
- the same content hash and other digests: the same code gave other bytes. Where the two ran under
  the same versions and CPU dispatch, that is *nondeterminism*; where they differ, a *platform*
  difference. Either way both receipts are kept for review in ``<arch>.jsonl.conflicts`` beside the
  receipts file, the directory keeps what it held for that target (nothing, where it held none),
  and the merge reports it and fails;
- another content hash: the receipt of the code as it is now wins (the incoming one when it is fresh
  for the current catalog, or when the directory has none); an incoming receipt of other code is
  left out, and said;
- a target the catalog does not know is left out, and said.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from certify.catalog.load import Catalog
from certify.files.atomic import atomic_write_bytes, locked
from certify.receipts.codehash import content_hash
from certify.receipts.store import Receipt, _read_book, load_receipts, write_receipts


@dataclass(frozen=True)
class Conflict:
    arch: str
    key: tuple[str, str, str]
    kind: str                 # nondeterminism | platform
    kept: Receipt
    other: Receipt
    source: str               # the file the other receipt came from

    def __str__(self) -> str:
        differ = sorted(n for n in {*self.kept.digests, *self.other.digests}
                        if self.kept.digests.get(n) != self.other.digests.get(n))
        where = "" if self.kind == "nondeterminism" else " under other versions (" + ", ".join(
            f"{k}: {self.kept.versions.get(k)} / {self.other.versions.get(k)}"
            for k in sorted({*self.kept.versions, *self.other.versions})
            if self.kept.versions.get(k) != self.other.versions.get(k)) + ")"
        return (f"{self.kind}: {'::'.join(self.key)} on {self.arch}: the same code gave other bytes "
                f"in {', '.join(differ) or 'its outputs'}{where} ({self.source})")


@dataclass
class MergeResult:
    added: list[tuple[str, tuple[str, str, str]]] = field(default_factory=list)
    replaced: list[tuple[str, tuple[str, str, str]]] = field(default_factory=list)
    collapsed: int = 0
    conflicts: list[Conflict] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)   # why each incoming receipt was not taken
    damaged: list[str] = field(default_factory=list)    # lines of the sources that do not load


def source_files(sources: list[Path]) -> list[Path]:
    """Every ``*.jsonl`` of the sources (files, or folders searched to any depth), sorted."""
    out: list[Path] = []
    for s in map(Path, sources):
        out += [s] if s.is_file() else sorted(s.rglob("*.jsonl"))
    return sorted(set(out))


def _arch_of(path: Path, r: Receipt) -> str:
    return r.arch or path.stem


def _current_hash(catalog: Catalog, key: tuple[str, str, str]) -> str | None:
    op = catalog.ops.get(key[0])
    if op is None or key[1] not in {v.name for v in op.variants} or \
            key[2] not in {c.id for c in op.cells}:
        return None
    return content_hash(op, key[1], op.cell(key[2]))


def merge(catalog: Catalog, receipts_dir: Path, sources: list[Path], dry_run: bool = False
          ) -> MergeResult:
    """Fold the sources into ``receipts_dir`` (under its lock); see the module docstring."""
    receipts_dir = Path(receipts_dir)
    res = MergeResult()
    with locked(receipts_dir):
        books = load_receipts(receipts_dir, []) if receipts_dir.is_dir() else {}
        chosen: dict[tuple[str, tuple[str, str, str]], tuple[Receipt, str]] = {}
        for path in source_files(sources):
            if path.resolve().parent == receipts_dir.resolve():
                continue  # the directory itself is never its own source
            book, bad = _read_book(path)
            res.damaged += [str(p) for p in bad]
            for key, r in book.items():
                arch = _arch_of(path, r)
                now = _current_hash(catalog, key)
                if now is None:
                    res.left_out.append(f"{path}: {'::'.join(key)} is no target of the catalog")
                    continue
                held = chosen.get((arch, key), (books.get(arch, {}).get(key), "receipts"))[0]
                if held is not None and held.hash == r.hash:
                    if held.digests == r.digests:
                        res.collapsed += 1
                        continue
                    kind = "nondeterminism" if held.versions == r.versions else "platform"
                    res.conflicts.append(Conflict(arch, key, kind, held, r, str(path)))
                    continue
                if r.hash != now and held is not None:
                    res.left_out.append(f"{path}: {'::'.join(key)} on {arch} certifies other code "
                                        "than the catalog's (stale); the directory's receipt stays")
                    continue
                (res.replaced if held is not None else res.added).append((arch, key))
                chosen[(arch, key)] = (r, str(path))
        disputed = {(c.arch, c.key) for c in res.conflicts}
        for k in disputed & set(chosen):   # a disputed target keeps what the directory holds
            del chosen[k]
            res.added = [a for a in res.added if a != k]
            res.replaced = [a for a in res.replaced if a != k]
        if not dry_run:
            write_receipts(receipts_dir, [r for r, _ in chosen.values()])
            _keep_for_review(receipts_dir, res.conflicts)
    return res


def _keep_for_review(receipts_dir: Path, conflicts: list[Conflict]) -> None:
    """Append both receipts of each conflict to ``<arch>.jsonl.conflicts``, once."""
    for arch in sorted({c.arch for c in conflicts}):
        side = receipts_dir / f"{arch}.jsonl.conflicts"
        old = side.read_bytes() if side.is_file() else b""
        lines = old.split(b"\n")
        new = []
        for c in (c for c in conflicts if c.arch == arch):
            record = json.dumps({"kind": c.kind, "target": list(c.key), "kept": c.kept.model_dump(),
                                 "other": c.other.model_dump(), "source": c.source},
                                sort_keys=True).encode()
            if record not in lines and record not in new:
                new.append(record)
        if new:
            atomic_write_bytes(side, old + b"".join(line + b"\n" for line in new))


def merge_text(res: MergeResult, dry_run: bool) -> str:
    verb = "would take" if dry_run else "took"
    lines = [f"{verb} {len(res.added)} new and {len(res.replaced)} newer receipt(s); "
             f"{res.collapsed} already held; {len(res.conflicts)} conflict(s); "
             f"{len(res.left_out)} left out; {len(res.damaged)} damaged line(s)"]
    lines += [f"  CONFLICT {c}" for c in res.conflicts]
    lines += [f"  left out: {w}" for w in res.left_out]
    lines += [f"  damaged: {d}" for d in res.damaged]
    if res.conflicts and not dry_run:
        lines.append("both receipts of each conflict are kept in <arch>.jsonl.conflicts beside the "
                     "receipts: find out which is right before re-certifying")
    return "\n".join(lines)
