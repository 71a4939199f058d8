"""The framework stays readable by module: no module of certify/ over 400 lines (a module that
grows past it splits by concern, as certify/lists/ did), and bad input has one error class."""

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


def _file_line_field_errors(root: Path) -> list[str]:
    """Exception classes that carry (file, line, field): the shape of a bad-input error."""
    import ast
    found = []
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "Exception"
                                                      for b in node.bases):
                fields = {s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if {"file", "line", "field"} <= fields:
                    found.append(f"{p.relative_to(root)}:{node.name}")
    return found


def test_bad_input_has_one_error_class():
    assert _file_line_field_errors(Path(certify.__file__).parent) == ["files/problem.py:FileProblem"]


def test_the_error_class_check_sees_a_second_one(tmp_path):
    (tmp_path / "a.py").write_text("class E(Exception):\n    file: str\n    line: int\n    field: str\n")
    assert _file_line_field_errors(tmp_path) == ["a.py:E"]
