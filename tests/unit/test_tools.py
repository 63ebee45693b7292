"""The agent's tool registry and built-in tools: every kind of model garbage becomes a readable
ToolResult, the calculator agrees with Python's exact arithmetic and refuses anything else,
and the python tool runs in the real sandbox (real subprocesses, no mocks)."""

import json
import logging
import random
import subprocess
import sys

import pytest

from disagg.agent.tools import ToolRegistry, ToolSpec, calculator, tool_from_function
from disagg.errors import ConfigError


def word_count(text: str, min_len: int = 1, exact: bool = False) -> int:
    """Count the words of a text.

    Words shorter than min_len are not counted.
    """
    return sum(1 for w in text.split() if len(w) >= min_len)


def explode(n: int) -> str:
    """Always fails."""
    raise KeyError(f"no item {n}")


@pytest.fixture
def registry():
    return ToolRegistry.from_config(["calculator", "tests.unit.test_tools:word_count"])


@pytest.mark.parametrize("seed", range(5))
def test_calculator_large_products_are_exact(seed):
    rng = random.Random(seed)
    a, b, c = (rng.randrange(10 ** 12, 10 ** 18) for _ in range(3))
    assert calculator(f"{a} * {b} * {c}") == str(a * b * c)
    assert calculator(f"{a}*{b} - {c}//7 + {c}%7") == str(a * b - c // 7 + c % 7)


@pytest.mark.parametrize("expression, expected", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-2 ** 2", "-4"), ("(-2) ** 2", "4"), ("2 ** 3 ** 2", "512"),
    ("--5 + +3", "8"), ("7 / 2", "3.5"), ("6 / 3", "2"), ("7 // 2", "3"), ("-7 // 2", "-4"), ("-7 % 3", "2"),
    ("0.1 + 0.2", "0.3"), ("2 ** -2", "0.25"), ("  ( 1 +\n 2 )  ", "3"),
])
def test_calculator_precedence_unary_and_division(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, needle", [
    ("__import__('os')", "function calls are not allowed: __import__('os')"),
    ("x + 1", "names are not allowed: x"),
    ("abs(-3)", "function calls are not allowed: abs(-3)"),
    ("(1).real", "attributes are not allowed"),
    ("'a' * 3", "'a'"),
    ("True + 1", "True"),
    ("[1, 2]", "List"),
    ("2 ** 65", "exponent 65"),
    ("99999 ** 64 ** 2", "exponent 4096"),
    ("(10 ** 60) ** 6", "300 digits"),
    ("1 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0.0", "division by zero"),
    ("1" * 201, "limit is 200"),
    ("1 +", "not an arithmetic expression"),
])
def test_calculator_rejects_via_registry(registry, expression, needle):
    r = registry.call("calculator", {"expression": expression})
    assert (r.ok, r.error_kind) == (False, "tool_error")
    assert r.content.startswith("error: ValueError: ") and needle in r.content
    assert registry.counts["tool_error"] == 1


def test_calculator_success_via_json_string(registry):
    r = registry.call("calculator", json.dumps({"expression": "123456 * 302"}))
    assert (r.ok, r.content, r.error_kind) == (True, str(123456 * 302), None)
    assert registry.counts["ok"] == 1


@pytest.mark.parametrize("name, arguments, kind, needles", [
    ("calc", {"expression": "1"}, "unknown_tool", ["'calc'", "calculator, word_count"]),
    ("calculator", '{"expression": "1"', "bad_json", ["calculator", '{"expression": "1"']),
    ("calculator", "[1, 2]", "bad_json", ["calculator", "not a JSON object", "[1, 2]"]),
    ("calculator", "{}", "bad_arguments", ["missing", "'expression'"]),
    ("calculator", {"expression": "1", "precision": 3}, "bad_arguments", ["unexpected", "'precision'"]),
    ("calculator", {"expression": 5}, "bad_arguments", ["'expression'", "string", "integer 5"]),
    ("word_count", {"text": "a b", "min_len": "2"}, "bad_arguments", ["'min_len'", "integer", 'string "2"']),
    ("word_count", {"text": "a b", "min_len": True}, "bad_arguments", ["'min_len'", "boolean"]),
])
def test_registry_turns_model_garbage_into_results(registry, name, arguments, kind, needles):
    r = registry.call(name, arguments)
    assert (r.ok, r.error_kind) == (False, kind)
    assert r.content.startswith("error: ")
    for needle in needles:
        assert needle in r.content
    assert registry.counts == {kind: 1}


def test_bad_json_excerpt_is_short(registry):
    r = registry.call("calculator", "{" + "x" * 5000)
    assert r.error_kind == "bad_json" and len(r.content) < 200


def test_tool_raising_is_reported_and_logged_once(caplog):
    registry = ToolRegistry([tool_from_function(explode)])
    with caplog.at_level(logging.WARNING, logger="disagg.agent"):
        results = [registry.call("explode", {"n": i}) for i in range(3)]
    assert [r.content for r in results] == [f"error: KeyError: 'no item {i}'" for i in range(3)]
    assert {(r.ok, r.error_kind) for r in results} == {(False, "tool_error")}
    assert registry.counts["tool_error"] == 3
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "explode" in tracebacks[0].getMessage()


def test_long_results_are_truncated_with_a_marker():
    spec = ToolSpec("echo", "Echo.", {"type": "object", "properties": {"s": {"type": "string"}},
                                      "required": ["s"]}, lambda s: s)
    registry = ToolRegistry([spec], max_result_chars=200)
    r = registry.call("echo", {"s": "y" * 1000})
    assert r.ok and len(r.content) == 200 and r.content.startswith("y" * 100)
    assert "truncated 1000 chars" in r.content
    assert registry.call("echo", {"s": "short"}).content == "short"
    assert registry.counts == {"ok": 2, "truncated": 1}


def test_user_tool_schema_and_call(registry):
    tools = {t["function"]["name"]: t for t in registry.openai_tools()}
    assert tools["calculator"]["type"] == "function"
    calc = tools["calculator"]["function"]
    assert calc["parameters"] == {"type": "object", "properties": {"expression": {"type": "string"}},
                                  "required": ["expression"]}
    assert "arithmetic" in calc["description"]
    wc = tools["word_count"]["function"]
    assert wc["description"] == "Count the words of a text."
    assert wc["parameters"] == {
        "type": "object", "required": ["text"],
        "properties": {"text": {"type": "string"}, "min_len": {"type": "integer", "default": 1},
                       "exact": {"type": "boolean", "default": False}}}
    r = registry.call("word_count", '{"text": "a bb ccc", "min_len": 2}')
    assert (r.ok, r.content) == (True, "2")


def test_duplicate_registration_names_the_tool():
    spec = tool_from_function(word_count)
    with pytest.raises(ValueError, match="word_count"):
        ToolRegistry([spec, spec])
    with pytest.raises(ConfigError, match="calculator"):
        ToolRegistry.from_config(["calculator", "calculator"])


@pytest.mark.parametrize("names, needles", [
    (["no_such_module_xyz:fn"], ["agent.tools", "no_such_module_xyz:fn"]),
    (["tests.unit.test_tools:missing_fn"], ["agent.tools", "missing_fn"]),
    (["tests.unit.test_tools:ToolRegistry.nope"], ["agent.tools", "ToolRegistry.nope"]),
    (["calculator", "wolfram"], ["agent.tools", "'wolfram'", "calculator, python"]),
])
def test_from_config_errors(names, needles):
    with pytest.raises(ConfigError) as e:
        ToolRegistry.from_config(names)
    for needle in needles:
        assert needle in str(e.value)


@pytest.fixture(scope="module")
def python_registry():
    # Room for a busy machine to start the snippet's interpreter and run it (or print before the timeout).
    return ToolRegistry.from_config(["python"], python_timeout_s=3.0)


def test_python_tool_returns_stdout(python_registry):
    r = python_registry.call("python", {"code": "print(6*7)"})
    assert (r.ok, r.content) == (True, "42")
    r = python_registry.call("python", {"code": "import sys\nfor i in range(3):\n    sys.stdout.write(str(i))\n"})
    assert (r.ok, r.content) == (True, "012")


def test_python_tool_timeout(python_registry):
    r = python_registry.call("python", {"code": "print('started')\nwhile True: pass"})
    assert (r.ok, r.error_kind) == (False, "timeout")
    assert "timeout after 3.0 s" in r.content and "started" in r.content


def test_python_tool_exception(python_registry):
    r = python_registry.call("python", {"code": "print('before')\n{}['k']"})
    assert (r.ok, r.error_kind) == (False, "tool_error")
    assert r.content.startswith("error: before\n") and "KeyError: 'k'" in r.content


def test_import_pulls_in_no_torch_vllm_or_ray():
    code = "import sys, disagg.agent.tools; print(sorted({'torch', 'vllm', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
