"""A multi-turn task that needs a tool: multiply two numbers too large to guess.

``"what is 4821*7733?"`` with the ``calculator`` tool offered. The tiny model
cannot multiply 4-digit numbers; it gets full marks only by calling the
calculator with the right expression and answering with the result it gets
back - a two-turn trajectory (call, then answer).

Reward ``calculator`` (rule-based) reads the whole trajectory text (tool calls
and tool responses included, as the agent runner hands it over):
1.0 for the exact product as the final answer; 0.5 for answering with the
number the calculator returned (the tool was used, an operand was mis-copied);
0.2 for a calculator call that returned a number but an answer that ignores it;
0 otherwise (no call, a malformed call, a guess).

The warm start shows the format on a few worked trajectories, laid out by the
same ``ChatFormat`` the agent loop uses (tool responses masked out of the loss).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Iterator

from disagg.tasks.base import PromptRow, register_reward, row_rng, rows_from_cursor

TOOLS = ["calculator"]


def make_row(rng: random.Random, num_digits: int) -> dict[str, Any]:
    lo, hi = 10 ** (num_digits - 1), 10**num_digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"messages": [{"role": "user", "content": f"what is {a}*{b}?"}], "expression": f"{a}*{b}",
            "answer": str(a * b)}


_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def final_answer(trajectory: str) -> str:
    """The text of the last assistant turn (after the last tool response, if any)."""
    tail = trajectory.rsplit("</tool_response>", 1)[-1]
    tail = tail.rsplit("<|im_start|>assistant\n", 1)[-1] if "<|im_start|>" in tail else tail
    return tail.split("<|im_end|>", 1)[0].strip().rstrip(".")


@register_reward("calculator")
def calculator_reward(trajectory: str, row: dict[str, Any]) -> float:
    answer = final_answer(trajectory)
    if answer == str(row["answer"]):
        return 1.0
    results = [r.strip() for r in _RESPONSE.findall(trajectory) if _NUMBER.fullmatch(r.strip())]
    if not results:
        return 0.0
    return 0.5 if answer == results[-1] else 0.2


class CalculatorSource:
    """An endless, seeded stream of multiplication prompts (rows carry ``messages``)."""

    def __init__(self, num_digits: int, seed: int, start: int = 0):
        self.num_digits, self.seed, self.cursor = num_digits, seed, start

    @property
    def num_skipped(self) -> int:
        return 0

    def row_at(self, index: int) -> PromptRow:
        row = make_row(row_rng(self.seed, index), self.num_digits)
        return PromptRow(index, row["messages"][0]["content"], row)

    def __iter__(self) -> Iterator[PromptRow]:
        return rows_from_cursor(self)

    def sft_sequences(self, n: int, seed: int, fmt, tools: list[dict]) -> list[tuple[list[int], list[int]]]:
        """(token ids, loss mask) of ``n`` worked trajectories: call the calculator, answer with its result."""
        rng = random.Random(seed + 7_919)
        out = []
        for _ in range(n):
            row = make_row(rng, self.num_digits)
            call = json.dumps({"name": "calculator", "arguments": {"expression": row["expression"]}})
            turn1 = fmt.encode(f"<tool_call>{call}</tool_call>") + [fmt.end_of_turn_id]
            tool = fmt.tool_turn_ids([row["answer"]])
            turn2 = fmt.encode(row["answer"]) + [fmt.end_of_turn_id]
            prompt = fmt.prompt_ids(row["messages"], tools)
            ids = prompt + turn1 + tool + turn2
            mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
            out.append((ids, mask))
        return out
