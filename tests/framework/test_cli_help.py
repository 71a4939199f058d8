"""Every option and argument of the project's command lines says what it does (``help=``), so
``--help`` documents each one; a new option without help fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIS = ["certify/cli.py", "certify/gating/cli.py", "certify/lists/cli.py", "impl/model/cli.py"]


def _options_without_help(source: str) -> list[str]:
    missing = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" \
                and "help" not in {k.arg for k in node.keywords}:
            missing.append(f"line {node.lineno}: {ast.unparse(node)[:100]}")
    return missing


@pytest.mark.parametrize("path", CLIS)
def test_every_option_has_help(path):
    source = (ROOT / path).read_text()
    assert "add_argument" in source
    assert not _options_without_help(source), _options_without_help(source)


def test_the_check_sees_an_option_without_help():
    assert _options_without_help("p.add_argument('--x', type=int)\np.add_argument('--y', help='y')\n") \
        == ["line 1: p.add_argument('--x', type=int)"]
