"""The code-execution task: the model writes a Python function, assert tests judge it.

The reward runs the answer in ``disagg.sandbox`` and scores 1.0 when every
test passes, else 0.0. Why it failed (``failed``, ``error``, ``timeout``,
``memory``, ``syntax``, ``no_code``) is counted in a process-wide counter that a
caller logs as ``reward/code_<reason>``. The reward never runs model code in
this process.

The verdict is this process's: each test ``assert <expr> == <literal>`` (or another
form of ``sandbox_checks.SUPPORTED``) is split so that only ``<expr>`` runs with the
answer and its value is compared here, so the answer cannot fake a pass (an object
equal to everything, an early exit, rewritten builtins or harness). A row whose
tests are of another form raises ``ValueError`` naming the test; the reward worker
scores that 0 and counts it (``samples/reward_errors``). The built-in templates
below only write ``==`` and ``is True/False`` tests.
"""

from __future__ import annotations

import random
import re
import threading
from collections import Counter
from typing import Any, Callable

from disagg.tasks.base import register_reward, row_rng, rows_from_cursor
from disagg.sandbox import run_python

# A fenced block tagged python/py/python3 or untagged; an unclosed fence (the
# response ran out of tokens) runs to the end of the text.
_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)

_lock = threading.Lock()
_reasons: Counter[str] = Counter()


def extract_code(response: str) -> str:
    """The last fenced Python block of ``response``, else the whole text."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@register_reward("code_tests")
def code_tests_reward(response: str, row: dict[str, Any]) -> float:
    """1.0 if the answer passes ``row["tests"]`` (assert statements) in the sandbox, else 0.0.

    Raises ``ValueError`` when a test is not of a form judged outside the answer's process."""
    result = run_python(extract_code(response), row["tests"])
    with _lock:
        _reasons[result.reason] += 1
    return 1.0 if result.passed else 0.0


def reason_counts(reset: bool = False) -> dict[str, int]:
    """Outcomes of ``code_tests`` calls so far (since the last reset), by reason."""
    with _lock:
        counts = dict(_reasons)
        if reset:
            _reasons.clear()
    return counts


def _add(rng: random.Random) -> tuple[str, list[str]]:
    pairs = [(rng.randint(-99, 99), rng.randint(-99, 99)) for _ in range(3)]
    return ("Write a Python function add(a, b) that returns a + b.\n",
            [f"assert add({a}, {b}) == {a + b}" for a, b in pairs])


def _max_of_list(rng: random.Random) -> tuple[str, list[str]]:
    lists = [[rng.randint(-50, 50) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    return ("Write a Python function max_of_list(xs) that returns the largest number in the non-empty list xs.\n",
            [f"assert max_of_list({xs}) == {max(xs)}" for xs in lists])


def _reverse_string(rng: random.Random) -> tuple[str, list[str]]:
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(0, 7))) for _ in range(3)]
    return ("Write a Python function reverse_string(s) that returns the string s reversed.\n",
            [f"assert reverse_string({w!r}) == {w[::-1]!r}" for w in words])


def _is_even(rng: random.Random) -> tuple[str, list[str]]:
    nums = [rng.randint(-100, 100) for _ in range(4)]
    return ("Write a Python function is_even(n) that returns True if the integer n is even, else False.\n",
            [f"assert is_even({n}) is {n % 2 == 0}" for n in nums])


def _factorial(rng: random.Random) -> tuple[str, list[str]]:
    nums = rng.sample(range(11), 3)
    prod = [1]
    for k in range(1, 11):
        prod.append(prod[-1] * k)
    return ("Write a Python function factorial(n) that returns n! for an integer n >= 0.\n",
            [f"assert factorial({n}) == {prod[n]}" for n in nums])


_TEMPLATES: list[Callable[[random.Random], tuple[str, list[str]]]] = [
    _add, _max_of_list, _reverse_string, _is_even, _factorial]


def make_code_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` seeded rows ``{"prompt", "tests"}`` drawn from a handful of one-function templates."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, asserts = rng.choice(_TEMPLATES)(rng)
        rows.append({"prompt": prompt, "tests": "\n".join(asserts) + "\n"})
    return rows


class CodeTaskSource:
    """An endless, seeded stream of code-task prompts (``data.task=code``), each with its tests."""

    def __init__(self, seed: int, start: int = 0) -> None:
        self.seed, self.cursor = seed, start

    @property
    def num_skipped(self) -> int:
        return 0

    def row_at(self, index: int):
        from disagg.tasks.base import PromptRow

        rng = row_rng(self.seed, index)
        prompt, asserts = rng.choice(_TEMPLATES)(rng)
        return PromptRow(index, prompt, {"prompt": prompt, "tests": "\n".join(asserts) + "\n"})

    def __iter__(self):
        return rows_from_cursor(self)
