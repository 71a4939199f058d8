"""certify/ is generic: no module of it names an op, a variant or a path of this target, nor the
target's model vocabulary. The target lives in spec/, impl/ and the YAML files."""

from __future__ import annotations

import re
from pathlib import Path

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths

PATHS = project_paths()
CERTIFY = PATHS.root / "certify"
# Generic names a catalog op may share with the framework's own vocabulary: a gate check kind.
FRAMEWORK_WORDS = {"acceptance_length"}
GENERIC_VARIANTS = {"torch", "triton", "spec", "spec_lowp", "gluon"}
TARGET_WORDS = [r"\bimpl\.(model|kernels|gates|tasks|train)\b", r"\bimpl/",
                r"\bspec\.(ops|model|cases|config|numerics)\b", r"\bspec/(ops|model|cases)\b",
                r"(?i)\b(gdn|qsa|moe|nvfp4|mtp|hyper-connections?|sinkhorn|deltanet|flashinfer)\b"]

def names_of_target() -> list[str]:
    cat = load_catalog(PATHS.cells)
    ops = set(cat.ops) - FRAMEWORK_WORDS
    variants = {v.name for op in cat.ops.values() for v in op.variants} - GENERIC_VARIANTS - ops
    return TARGET_WORDS + [rf"\b{re.escape(w)}\b" for w in sorted(ops | variants)]


def mentions(root: Path, patterns: list[str]) -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line) for p in patterns):
                found.append((str(path.relative_to(root)), i, line.strip()))
    return found


def test_certify_names_no_model():
    found = mentions(CERTIFY, names_of_target())
    assert found == [], "\n".join(f"certify/{f}:{i}: {line}" for f, i, line in found)


def test_a_planted_name_is_found(tmp_path):
    (tmp_path / "module.py").write_text('"""Chooses gdn_decode\'s split by hand."""\nX = 1\n')
    (tmp_path / "clean.py").write_text('"""Chooses a variant by its rule."""\n')
    found = mentions(tmp_path, names_of_target())
    assert [(f, i) for f, i, _ in found] == [("module.py", 1)]
