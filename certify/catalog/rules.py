"""Dispatch rules: small boolean expressions over a cell's axes, e.g. ``batch <= 32 and rows == 1``.

One rule string is read by the implementation (to choose a variant at run time) and by the
certification (to know which cells a variant serves), so the two cannot disagree. The grammar is a
safe subset of Python expressions: names (axes), numbers, strings, true/false, comparisons,
``and``/``or``/``not``, ``in`` with a list, and + - * // %.
"""

from __future__ import annotations

import ast
import operator
from functools import lru_cache
from typing import Any

_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CONST = {"true": True, "false": False}


class RuleError(ValueError):
    pass


@lru_cache(maxsize=None)
def parse_rule(rule: str) -> ast.Expression:
    try:
        tree = ast.parse(rule.strip() or "true", mode="eval")
    except SyntaxError as e:
        raise RuleError(f"cannot parse rule {rule!r}: {e.msg}") from None
    for node in ast.walk(tree):
        allowed = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub,
                   ast.Compare, ast.Name, ast.Load, ast.Constant, ast.List, ast.Tuple, ast.BinOp,
                   *_CMP, *_BIN)
        if not isinstance(node, allowed):
            raise RuleError(f"rule {rule!r} uses {type(node).__name__}, which rules do not allow")
    return tree


def rule_names(rule: str) -> set[str]:
    """The axis names a rule reads (true/false excluded)."""
    return {n.id for n in ast.walk(parse_rule(rule)) if isinstance(n, ast.Name)} - set(_CONST)


def evaluate(rule: str, axes: dict[str, Any]) -> bool:
    """Evaluate a rule over axis values; an unknown name is an error, never False."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BoolOp):
            vals = (ev(v) for v in node.values)
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            return (not v) if isinstance(node.op, ast.Not) else -v
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = ev(right_node)
                if not _CMP[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.BinOp):
            return _BIN[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Name):
            if node.id in _CONST:
                return _CONST[node.id]
            if node.id not in axes:
                raise RuleError(f"rule reads axis {node.id!r}, which is not given")
            return axes[node.id]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        raise RuleError(f"unsupported node {type(node).__name__}")

    return bool(ev(parse_rule(rule)))
