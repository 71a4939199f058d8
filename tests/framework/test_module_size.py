"""The framework stays readable by module: no module of certify/ over 400 lines (a module that
grows past it splits by concern, as certify/lists/ did)."""

from __future__ import annotations

from pathlib import Path

import certify

LIMIT = 400


def _sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}


def test_no_module_of_certify_is_over_the_limit():
    sizes = _sizes(Path(certify.__file__).parent)
    assert len(sizes) > 20, "the framework's modules were not found"
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them by concern): {over}"


def test_the_size_check_sees_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    (tmp_path / "short.py").write_text("x = 1\n")
    assert _sizes(tmp_path) == {"long.py": LIMIT + 1, "short.py": 1}
