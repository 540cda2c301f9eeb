"""Parsing fconv's layer options, e.g. ``--encoder-layers "[(512, 3)] * 9 + [(1024, 3)] * 4"``.

fconv passes these strings to eval(); we accept the same notation (list and tuple literals,
integers, booleans, + and *) without running arbitrary code, and say what is wrong otherwise.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

_OPERATORS = {ast.Add: operator.add, ast.Mult: operator.mul}


def _evaluate(node: ast.AST, option: str, text: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        items = [_evaluate(item, option, text) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, option, text), _evaluate(node.right, option, text)
        try:
            return _OPERATORS[type(node.op)](left, right)
        except TypeError:
            pass
    raise ValueError(
        f"{option} {text!r}: only list/tuple literals, integers, booleans, + and * are allowed"
    )


def _literal(text: Any, option: str) -> Any:
    if not isinstance(text, str):
        return text  # already parsed (e.g. set programmatically)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"{option} {text!r} is not a valid expression: {err.msg}") from None
    return _evaluate(tree.body, option, text)


def parse_layer_spec(text: Any, option: str) -> list[tuple[int, int, int]]:
    """Layers as (channels, kernel width, residual distance); the distance defaults to 1 (the
    previous layer) and 0 means no residual connection."""
    layers = _literal(text, option)
    if not isinstance(layers, list | tuple) or not layers:
        raise ValueError(f"{option} {text!r}: expected a non-empty list of (channels, width)")
    parsed = []
    for index, layer in enumerate(layers):
        ok = (
            isinstance(layer, list | tuple)
            and len(layer) in (2, 3)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in layer)
        )
        channels, width, residual = (tuple(layer) + (1,))[:3] if ok else (0, 0, 0)
        if not ok or channels < 1 or width < 1 or not 0 <= residual <= index + 1:
            raise ValueError(
                f"{option} {text!r}: layer {index} is {layer!r}; expected (channels >= 1, "
                f"width >= 1[, residual distance 0..{index + 1}])"
            )
        parsed.append((channels, width, residual))
    return parsed


def parse_attention_spec(text: Any, num_layers: int, option: str) -> list[bool]:
    """One flag per decoder layer; a single boolean applies to every layer."""
    value = _literal(text, option)
    flags = [value] * num_layers if isinstance(value, bool) else value
    if not isinstance(flags, list | tuple) or len(flags) != num_layers or not all(
        isinstance(flag, bool) for flag in flags
    ):
        raise ValueError(
            f"{option} {text!r}: expected True, False or a list of {num_layers} booleans "
            "(one per decoder layer)"
        )
    return list(flags)
