"""Assert tests judged outside the answer's process: split, decode, compare.

An answer that runs in the interpreter that runs its tests can fake a pass: read a
secret from its caller's frame and write the verdict itself, return an object whose
``__eq__`` is always True, replace the builtins or the harness, exit before the tests,
or read the expected values from the test file. For an RL policy that is a reward to
find. So ``run_python`` splits each test ``assert <expr> <op> <literal>`` here: only
``<expr>`` goes into the sandbox, whose child evaluates it after the answer and reports
its value as data (``runner.encode``: exact built-in types only); the caller
decodes that into fresh built-in objects and compares them with the literal. The
literal never enters the box (no file, argument or memory of it), so whatever the
answer writes back is at best a guess. ``assert <expr>`` and ``assert not <expr>`` take
the truth of the reported data here, not of an object of the answer's.

Limits. What the expression side holds is visible to the answer (it is evaluated in its
process): ``add(2, 3)`` shows it 2 and 3, as it must; a test whose expected value sits
in the expression (``assert abs(f(x) - 1.5) < 1e-6``) leaks it, so write the expected
value as the literal (``assert f(x) == 1.5``). Where the sandbox has no filesystem
isolation (``"none"``) the answer runs as the caller's user beside the host's files and
/proc, where a data set or this process's memory may hold the expected values.

This module never evaluates anything but ``ast.literal_eval`` of the tests' literals,
and decoding builds only exact built-in types, so nothing of the answer's runs here.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 100
"""Deepest nesting of a reported value; a deeper one is refused (comparing it could overflow the stack)."""

SUPPORTED = ("assert <expr> <op> <literal>, assert <literal> <op> <expr> (op: ==, !=, <, <=, >, >=, in, not in; "
             "is / is not only with True, False or None), assert <expr>, assert not <...>")
"""The forms ``parse_tests`` accepts (``<literal>``: what ``ast.literal_eval`` takes), for error messages."""

_OPS: dict[type[ast.cmpop], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Eq: ("==", operator.eq), ast.NotEq: ("!=", operator.ne),
    ast.Lt: ("<", operator.lt), ast.LtE: ("<=", operator.le), ast.Gt: (">", operator.gt), ast.GtE: (">=", operator.ge),
    ast.In: ("in", lambda a, b: a in b), ast.NotIn: ("not in", lambda a, b: a not in b),
    ast.Is: ("is", operator.is_), ast.IsNot: ("is not", operator.is_not),
}
_NO_LITERAL = object()
_INT = re.compile(r"-?0x[0-9a-f]+")
_SEQUENCES: dict[str, Callable[[list], Any]] = {"l": list, "t": tuple, "s": set, "z": frozenset}


@dataclass(frozen=True)
class Check:
    """One assert test, split: the child evaluates ``expr``; the caller compares its value."""

    source: str
    """The assert statement (normalised by ``ast.unparse``), for details."""
    expr: str
    """The expression the child evaluates in the answer's namespace (never holds the literal)."""
    op: str
    """"==", "!=", "<", "<=", ">", ">=", "in", "not in", "is", "is not", or "truth" (``assert <expr>``)."""
    expected: Any = None
    """The literal (``ast.literal_eval``); None for "truth"."""
    expr_left: bool = True
    """Whether the expression is the comparison's left side (``expr op expected``)."""
    negated: bool = False
    """``assert not ...``: passes when the comparison (or truth) does not hold."""


def parse_tests(tests: str) -> list[Check]:
    """The checks of ``tests``, one per assert statement, in order.

    Raises ``ValueError`` when ``tests`` does not compile, holds no assert, or holds a statement
    that is not of a supported form (``SUPPORTED``), naming it. Refused rather than run with the
    answer: a verdict the answer can forge is worse than none, since the policy learns the forgery;
    a reward that raises scores 0 and is counted and logged (``samples/reward_errors``), so a data
    set with such tests shows up at once. An assert's message is never evaluated.
    """
    try:
        module = ast.parse(tests, "tests.py")
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"tests do not compile: {e}") from e
    checks = []
    for i, stmt in enumerate(module.body):
        why = "not an assert statement" if not isinstance(stmt, ast.Assert) else None
        check = None if why else _split(stmt.test, ast.unparse(stmt), False)
        if isinstance(check, str):
            why = check
        if why is not None:
            raise ValueError(f"test {i + 1} cannot be judged outside the answer's process ({why}): "
                             f"{ast.get_source_segment(tests, stmt)!r}; supported: {SUPPORTED}")
        checks.append(check)
    if not checks:
        raise ValueError("tests hold no assert statement: every answer would pass")
    return checks


def _split(node: ast.expr, source: str, negated: bool) -> Check | str:
    """The check of ``assert node`` (negated), or why it has none."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _split(node.operand, source, not negated)
    if not isinstance(node, ast.Compare):
        return Check(source, ast.unparse(node), "truth", negated=negated)
    if len(node.ops) != 1:
        return "a chained comparison"
    op, (fn_name, _) = node.ops[0], _OPS[type(node.ops[0])]
    left, right = node.left, node.comparators[0]
    expected, expr_left = _literal(right), True
    if expected is _NO_LITERAL:
        expected, expr_left = _literal(left), False
    if expected is _NO_LITERAL:
        return "neither side is a literal"
    if isinstance(op, (ast.Is, ast.IsNot)) and not any(expected is s for s in (True, False, None)):
        return f"'{fn_name}' with a literal other than True, False or None"
    return Check(source, ast.unparse(left if expr_left else right), fn_name, expected, expr_left, negated)


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO_LITERAL


def decode(payload: str) -> Any:
    """The value a child reported (``runner.encode``'s JSON), as exact built-in types.

    Raises ``ValueError`` for anything else (the answer controls the child, so it may write anything).
    """
    try:
        return _decode(json.loads(payload), 0)
    except (TypeError, RecursionError, OverflowError) as e:  # an unhashable set member or dict key, too deep
        raise ValueError(f"not an encoded value: {type(e).__name__}: {e}") from e


def _decode(node: Any, depth: int) -> Any:
    if node is None or type(node) in (bool, str):
        return node
    if type(node) is not list or not node or depth > MAX_DEPTH:
        raise ValueError("not an encoded value")
    tag, args = node[0], node[1:]
    if tag == "i" and len(args) == 1 and type(args[0]) is str and _INT.fullmatch(args[0]):
        return int(args[0], 16)
    if tag == "f" and len(args) == 1 and type(args[0]) is str:
        return float.fromhex(args[0])
    if tag == "c" and len(args) == 2 and all(type(a) is str for a in args):
        return complex(float.fromhex(args[0]), float.fromhex(args[1]))
    if tag == "y" and len(args) == 1 and type(args[0]) is str:
        return bytes.fromhex(args[0])
    if tag in _SEQUENCES and len(args) == 1 and type(args[0]) is list:
        return _SEQUENCES[tag](_decode(x, depth + 1) for x in args[0])
    if tag == "d" and len(args) == 1 and type(args[0]) is list:
        pairs = [x for x in args[0] if type(x) is list and len(x) == 2]
        if len(pairs) != len(args[0]):
            raise ValueError("not an encoded value")
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in pairs}
    raise ValueError("not an encoded value")


def parse_results(data: bytes, num_checks: int) -> tuple[list[list[tuple[bytes, bytes]]], str | None]:
    """The (kind, payload) lines reported for each test, and the last status word. A line that is
    not of ``runner``'s forms, or not ended (cut at the limit), is ignored."""
    values: list[list[tuple[bytes, bytes]]] = [[] for _ in range(num_checks)]
    status = None
    for line in data.split(b"\n")[:-1]:
        kind, _, rest = line.partition(b" ")
        if kind == b"status":
            status = rest.decode("ascii", "replace")
        elif kind in (b"value", b"refused"):
            index, _, payload = rest.partition(b" ")
            if index.isdigit() and len(index) < 10 and int(index) < num_checks:
                values[int(index)].append((kind, payload))
    return values, status


def judge_reported(i: int, check: Check, reported: list[tuple[bytes, bytes]]) -> tuple[str, str] | None:
    """None if test ``i`` holds for what was reported for it, else the reason and detail."""
    if len(reported) > 1:  # only the answer writes a second line: it may not choose among them
        return "error", f"test {i + 1}'s value was reported {len(reported)} times ({check.source})"
    ((kind, payload),) = reported
    if kind == b"refused":
        return "failed", f"AssertionError: {check.source} ({check.expr} was {payload.decode('ascii', 'replace')})"
    try:
        value = decode(payload.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as e:
        return "error", f"test {i + 1}'s value could not be decoded ({e}; {check.source})"
    return judge(check, value)


def judge(check: Check, value: Any) -> tuple[str, str] | None:
    """None if ``value`` (decoded) passes ``check``, else (reason, detail): "failed" with the value,
    or "error" when the comparison raises as the assert would have (``'<'`` between str and int)."""
    try:
        if check.op == "truth":
            held = bool(value)
        else:
            fn = _OPS_BY_NAME[check.op]
            held = bool(fn(value, check.expected) if check.expr_left else fn(check.expected, value))
    except TypeError as e:
        return "error", f"TypeError: {e} ({check.source})"
    if held != check.negated:
        return None
    return "failed", f"AssertionError: {check.source} ({check.expr} was {_short(value)})"


_OPS_BY_NAME = dict(_OPS.values())


def _short(value: Any, max_chars: int = 200) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"a value too large to show ({type(value).__name__})"
    return text if len(text) <= max_chars else text[:max_chars] + "..."
