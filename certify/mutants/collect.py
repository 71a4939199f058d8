"""The op's guard and property tests as the test files hold them now, beside the item universe.

The item universe (``<lists>/items.json``) is written by ``certify lists`` and lags behind a test added
since; a mutant must still meet it. So the test files whose text names the op in a ``certify_guard``
or ``certify_property`` marker are collected again (``pytest --collect-only --certify-items``, in a
warm worker's child or a subprocess, so nothing of the project is imported here), and their items
replace the universe's items of the same files. A marker whose op is not written out as a string
literal is found through the universe only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from certify.files.paths import ProjectPaths
from certify.mutants.pool import WarmPool

COLLECT_S = 600.0   # the most seconds the collection may take
SKIP_DIRS = {".git", "__pycache__", "node_modules", "reports"}


def test_roots(paths: ProjectPaths) -> list[Path]:
    """The folders pytest collects from: the pyproject's ``testpaths``, or the project root."""
    py = paths.root / "pyproject.toml"
    cfg = tomllib.loads(py.read_text()) if py.is_file() else {}
    names = cfg.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("testpaths", [])
    roots = [paths.root / n for n in names if (paths.root / n).is_dir()]
    return roots or [paths.root]


def marked_files(paths: ProjectPaths, op: str) -> list[str]:
    """The test files (relative to the root) whose text names ``op`` in a guard or property marker."""
    pattern = re.compile(r"certify_(?:guard|property)\(\s*(['\"])" + re.escape(op) + r"\1")
    found = set()
    for root in test_roots(paths):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
            for f in filenames:
                if f.endswith(".py") and (f.startswith("test_") or f.endswith("_test.py")):
                    p = Path(dirpath) / f
                    if pattern.search(p.read_text(encoding="utf-8", errors="replace")):
                        found.add(p.relative_to(paths.root).as_posix())
    return sorted(found)


def collect_items(paths: ProjectPaths, files: list[str], pool: WarmPool | None = None) -> list[dict]:
    """The item records of ``files`` (``certify.lists.records.item_record``), collected now (in one
    of ``pool``'s warm workers when given)."""
    if not files:
        return []
    with tempfile.TemporaryDirectory(prefix="certify-mutants-collect-") as tmp:
        out = Path(tmp) / "items.json"
        args = ["--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "--certify-items",
                str(out), *files]
        if pool is not None:
            code, output = pool.pytest(args, Path(tmp), "collect", COLLECT_S)
        else:
            res = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=paths.root,
                                 capture_output=True, text=True)
            code, output = res.returncode, res.stdout + res.stderr
        if not out.is_file():
            raise RuntimeError(f"collecting {files} failed (pytest exit {code}): {output[-1500:]}")
        return json.loads(out.read_text())["items"]


def current_items(paths: ProjectPaths, op: str, items: list[dict],
                  pool: WarmPool | None = None) -> list[dict]:
    """``items`` with the items of the files that name ``op`` in a marker collected again."""
    files = marked_files(paths, op)
    fresh = collect_items(paths, files, pool)
    stale = set(files)
    return [r for r in items if r["id"].split("::", 1)[0] not in stale] + fresh
