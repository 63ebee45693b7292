"""The embedded default task: reverse a string of digits.

``"4821="`` -> ``"1284"``. The reward gives per-position credit (fraction of
positions right), halved when the length is wrong. REFERENCE.md records that a
tiny Qwen2 learns this by GRPO after a short supervised warm start, where
harder tasks (addition) do not move at this size.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

from disagg.tasks.base import PromptRow, register_reward, row_rng, rows_from_cursor


def make_row(rng: random.Random, num_digits: int) -> dict[str, Any]:
    digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
    return {"prompt": f"{digits}=", "answer": digits[::-1]}


@register_reward("reverse_digits")
def reverse_digits_reward(response: str, row: dict[str, Any]) -> float:
    target = str(row["answer"])
    got = response.strip()
    hits = sum(1 for a, b in zip(got, target) if a == b)
    score = hits / len(target)
    return score if len(got) == len(target) else score / 2


class ReverseDigitsSource:
    """An endless, seeded stream of reverse-digits prompts."""

    def __init__(self, num_digits: int, seed: int, start: int = 0):
        self.num_digits = num_digits
        self.seed = seed
        self.cursor = start

    @property
    def num_skipped(self) -> int:
        return 0

    def row_at(self, index: int) -> PromptRow:
        row = make_row(row_rng(self.seed, index), self.num_digits)
        return PromptRow(index, row["prompt"], row)

    def __iter__(self) -> Iterator[PromptRow]:
        return rows_from_cursor(self)

    def sft_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """(prompt, completion) pairs for the warm start, disjoint seed space."""
        rng = random.Random(seed + 7_919)
        out = []
        for _ in range(n):
            row = make_row(rng, self.num_digits)
            out.append((row["prompt"], row["answer"]))
        return out
