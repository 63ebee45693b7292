"""The tools a policy may call during a multi-turn rollout, and the registry that calls them.

The registry speaks the OpenAI tools format: ``openai_tools()`` is what goes into the
chat template, ``call(name, arguments)`` runs what the model asked for. The model's
call is untrusted text, so ``call`` never raises for it: an unknown tool, arguments
that are not a JSON object, a missing, extra or mistyped argument, or a tool that
raises all come back as a ``ToolResult`` with ``ok=False``, a message the model can
read and act on, and an ``error_kind`` counted in ``ToolRegistry.counts``.

Built-ins: ``calculator`` (arithmetic parsed with ``ast``, never ``eval``) and
``python`` (a snippet run in ``disagg.sandbox``, never in this process).
User tools are ``module:function`` names whose JSON schema comes from the signature.
This module must not import torch, vLLM or Ray: it runs inside rollout workers.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import math
import operator
import typing
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable

from disagg.errors import ConfigError
from disagg.tasks.base import import_callable
from disagg.sandbox import run_snippet

log = logging.getLogger("disagg.agent")

_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                                list: "array", dict: "object"}
_PYTHON_TYPES = {v: k for k, v in _JSON_TYPES.items()}
_EXCERPT_CHARS = 80


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments: {"type": "object", "properties": {...}, "required": [...]}."""
    fn: Callable[..., Any]

    def openai(self) -> dict[str, Any]:
        """This tool as one entry of the OpenAI ``tools`` list."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolResult:
    content: str
    """What goes back to the model as the tool message."""
    ok: bool
    error_kind: str | None = None
    """None when ok, else unknown_tool, bad_json, bad_arguments, tool_error or timeout."""


class ToolFailure(Exception):
    """Raised by a tool for an expected failure: no traceback is logged, ``kind`` is counted."""

    def __init__(self, message: str, kind: str = "tool_error") -> None:
        super().__init__(message)
        self.kind = kind


class ToolRegistry:
    """Tools by name; ``call`` turns any model output into a ``ToolResult``."""

    def __init__(self, specs: Iterable[ToolSpec] = (), max_result_chars: int = 2000) -> None:
        if max_result_chars < 100:
            raise ValueError(f"max_result_chars={max_result_chars} is too small for an error message (< 100)")
        self.max_result_chars = max_result_chars
        self.counts: Counter[str] = Counter()
        """Outcomes of ``call``: "ok", "truncated" and each error kind."""
        self._specs: dict[str, ToolSpec] = {}
        self._logged: set[tuple[str, str]] = set()
        for spec in specs:
            self.register(spec)

    def register(self, spec: ToolSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"tool {spec.name!r} is registered twice")
        self._specs[spec.name] = spec

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    def openai_tools(self) -> list[dict[str, Any]]:
        return [spec.openai() for spec in self._specs.values()]

    def call(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        """Run tool ``name`` on ``arguments`` (a JSON object, or its text; "" means no arguments)."""
        spec = self._specs.get(name)
        if spec is None:
            return self._fail("unknown_tool", f"unknown tool {name!r}; available tools: {', '.join(self._specs)}")
        args = _parse_arguments(arguments)
        if args is None:
            return self._fail("bad_json", f"arguments of {name} are not a JSON object: {_excerpt(arguments)}")
        problem = _check_arguments(name, spec.parameters, args)
        if problem:
            return self._fail("bad_arguments", problem)
        try:
            out = spec.fn(**args)
        except ToolFailure as e:
            return self._fail(e.kind, str(e))
        except Exception as e:  # the tool's own bug or its refusal of the input: reported to the model
            key = (name, type(e).__name__)
            if key not in self._logged:
                self._logged.add(key)
                log.warning("tool %s raised %s (logged once; later ones are only counted)", name, key[1],
                            exc_info=True)
            return self._fail("tool_error", f"{type(e).__name__}: {e}")
        self.counts["ok"] += 1
        return ToolResult(self._truncate(out if isinstance(out, str) else json.dumps(out, default=str)), True)

    def _fail(self, kind: str, message: str) -> ToolResult:
        self.counts[kind] += 1
        return ToolResult(self._truncate(f"error: {message}"), False, kind)

    def _truncate(self, text: str) -> str:
        if len(text) <= self.max_result_chars:
            return text
        self.counts["truncated"] += 1
        marker = f"\n[... truncated {len(text)} chars to {self.max_result_chars}]"
        return text[:self.max_result_chars - len(marker)] + marker

    @classmethod
    def from_config(cls, names: list[str] | tuple[str, ...], *, python_timeout_s: float = 5.0,
                    max_result_chars: int = 2000) -> ToolRegistry:
        """Built-ins by name ("calculator", "python"), user tools as "module:function"."""
        if not python_timeout_s > 0:
            raise ConfigError(f"python_timeout_s={python_timeout_s!r} must be > 0")
        builtins: dict[str, Callable[[], ToolSpec]] = {
            "calculator": lambda: tool_from_function(calculator),
            "python": lambda: python_tool(timeout_s=python_timeout_s),
        }
        registry = cls(max_result_chars=max_result_chars)
        for name in names:
            if ":" in name:
                spec = _user_tool(name)
            elif name in builtins:
                spec = builtins[name]()
            else:
                raise ConfigError(f"agent.tools: unknown tool {name!r}; built-in tools are "
                                  f"{', '.join(builtins)}, user tools are written 'module:function'")
            if spec.name in registry.names:
                raise ConfigError(f"agent.tools: {name!r} gives tool name {spec.name!r} a second time")
            registry.register(spec)
        return registry


def _user_tool(ref: str) -> ToolSpec:
    fn = import_callable(ref, "agent.tools")
    try:
        return tool_from_function(fn)
    except ValueError as e:
        raise ConfigError(f"agent.tools: {ref!r}: {e}") from e


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> ToolSpec:
    """A ToolSpec whose schema comes from ``fn``'s signature and whose description is its docstring's
    first paragraph. Parameters without a default are required."""
    name = name or fn.__name__
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name} has no docstring; its first paragraph is the description the model sees")
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"tool {name}: parameter {p.name!r} cannot be passed by keyword from JSON")
        prop: dict[str, Any] = {}
        if p.name in hints:
            hint = hints[p.name]
            json_type = _JSON_TYPES.get(typing.get_origin(hint) or hint)
            if json_type is None:
                raise ValueError(f"tool {name}: parameter {p.name!r} has type {hint!r}; "
                                 f"use one of {', '.join(t.__name__ for t in _JSON_TYPES)}")
            prop["type"] = json_type
        if p.default is p.empty:
            required.append(p.name)
        elif isinstance(p.default, (str, int, float, bool)):
            prop["default"] = p.default
        properties[p.name] = prop
    return ToolSpec(name, " ".join(doc.split("\n\n")[0].split()),
                    {"type": "object", "properties": properties, "required": required}, fn)


def _parse_arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | None:
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def _check_arguments(tool: str, schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """Why ``args`` do not fit ``schema`` (one message naming the parameter), or None."""
    properties = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in args:
            return f"{tool} is missing required argument {key!r}"
    for key, value in args.items():
        if key not in properties:
            return f"{tool} got unexpected argument {key!r}; its parameters are: {', '.join(properties) or 'none'}"
        want = properties[key].get("type")
        if want is not None and not _is_json_type(value, want):
            got = "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)
            return f"argument {key!r} of {tool} must be of type {want}, got {got} {json.dumps(value)[:_EXCERPT_CHARS]}"
    return None


def _is_json_type(value: Any, json_type: str) -> bool:
    if isinstance(value, bool):
        return json_type == "boolean"
    if json_type == "number":
        return isinstance(value, (int, float))
    expected = _PYTHON_TYPES.get(json_type)
    return expected is None or isinstance(value, expected)


def _excerpt(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:_EXCERPT_CHARS] + ("..." if len(text) > _EXCERPT_CHARS else ""))


# --- built-in tools ----------------------------------------------------------------------------

_MAX_EXPRESSION_CHARS = 200
_MAX_EXPONENT = 64
_MAX_INT = 10 ** 300  # intermediate ints must stay below 300 digits
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARYOPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers and decimals, + - * / // % ** and parentheses.

    Integer arithmetic is exact (no rounding), e.g. "123456 * 789012".
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(expression)} characters; the limit is {_MAX_EXPRESSION_CHARS}")
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return _format_number(_evaluate(tree.body, source))


def _evaluate(node: ast.AST, source: str) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
        return _UNARYOPS[type(node.op)](_evaluate(node.operand, source))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (limit {_MAX_EXPONENT})")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise ValueError("division by zero")
        try:
            value = _BINOPS[type(node.op)](left, right)
        except OverflowError:
            raise ValueError("result is too large") from None
        if isinstance(value, complex):
            raise ValueError(f"{ast.get_source_segment(source, node)} has no real value")
        return _checked(value)
    what = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes",
            ast.Constant: "literals other than numbers"}.get(type(node), f"{type(node).__name__} elements")
    raise ValueError(f"{what} are not allowed: {ast.get_source_segment(source, node) or ast.dump(node)}")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and abs(value) >= _MAX_INT:
        raise ValueError("result is too large (more than 300 digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is too large")
    return value


def _format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".12g")


def python(code: str, *, timeout_s: float = 5.0, memory_bytes: int = 256 << 20) -> str:
    """Run a Python snippet in the sandbox and return what it printed."""
    r = run_snippet(code, timeout_s=timeout_s, memory_bytes=memory_bytes, max_output_bytes=16 << 10)
    stdout = r.stdout.rstrip("\n")
    if r.reason == "passed":
        return stdout or "(no output; print() what you want to see)"
    printed = f"{stdout}\n" if stdout else ""
    if r.reason == "timeout":
        raise ToolFailure(f"{printed}timeout after {timeout_s} s", "timeout")
    if r.reason == "memory":
        raise ToolFailure(f"{printed}out of memory (limit {memory_bytes >> 20} MiB)")
    if r.reason == "no_code":
        raise ToolFailure("no code given")
    raise ToolFailure(f"{printed}{r.detail or r.reason}")


def python_tool(timeout_s: float = 5.0, memory_bytes: int = 256 << 20) -> ToolSpec:
    """The ``python`` built-in with its limits bound (the model sees only ``code``)."""
    return ToolSpec("python", f"Run a Python 3 program (no network, {timeout_s} s limit) and return what it "
                    "printed to stdout; print() every value you want to see.",
                    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                    partial(python, timeout_s=timeout_s, memory_bytes=memory_bytes))
