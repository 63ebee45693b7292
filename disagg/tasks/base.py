"""What a task is: a stream of prompt rows and a reward function.

A row is a dict with at least ``prompt`` (text); other columns travel with the
sample to the reward. Rewards are plain functions ``(response_text, row) ->
float``; they are looked up by name in a registry or imported by
``module:function``. A reward that raises scores 0 and is counted by the caller.
"""

from __future__ import annotations

import importlib
import logging
import random
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from disagg.errors import ConfigError

RewardFn = Callable[[str, dict[str, Any]], float]

log = logging.getLogger("disagg.scoring")  # where reward failures have always been reported

_REWARDS: dict[str, RewardFn] = {}


def registered_rewards() -> dict[str, RewardFn]:
    """The rewards registered so far by name (``disagg.tasks.get_reward`` imports the built-in ones)."""
    return dict(_REWARDS)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        _REWARDS[name] = fn
        return fn

    return deco


def import_callable(ref: str, key: str) -> Callable:
    """The function a ``module:function`` config value names; a ConfigError quoting ``key=ref`` if not."""
    from disagg.config.checks import is_module_function

    if not is_module_function(ref):
        raise ConfigError(f"{key}={ref!r}: expected 'module:function'")
    mod_name, _, fn_name = ref.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{key}={ref!r}: cannot import module {mod_name!r}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{key}={ref!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


@dataclass
class PromptRow:
    """One prompt with its reward context. ``index`` is its position in the data stream."""

    index: int
    prompt: str
    row: dict[str, Any]


class PromptSource(Protocol):
    """A deterministic, endless stream of rows: row ``i`` is the same whenever it is asked for.

    ``cursor`` is the index of the next row ``__iter__`` yields (the ``start`` a source is
    built with); a resumed run starts there and asks ``row_at`` for the rows that were
    drawn but not trained when its checkpoint was written.
    """

    cursor: int

    def __iter__(self) -> Iterator[PromptRow]: ...

    def row_at(self, index: int) -> PromptRow: ...

    @property
    def num_skipped(self) -> int: ...


def rows_from_cursor(source: PromptSource) -> Iterator[PromptRow]:
    """``source.row_at`` from ``source.cursor`` on; the cursor moves before each row is yielded, so it is
    always the next row never drawn (what a checkpoint saves)."""
    while True:
        source.cursor += 1
        yield source.row_at(source.cursor - 1)


def row_rng(seed: int, index: int) -> random.Random:
    """The generator of row ``index`` of a seeded synthetic task: the same row whenever it is asked for."""
    return random.Random(seed * 1_000_003 + index)


def safe_reward(fn: RewardFn, text: str, row: dict[str, Any], counts: Counter, logged: set[str],
                latency_s: float = 0.0) -> float:
    """``fn(text, row)`` as a float; an exception or NaN scores 0 and is counted in ``counts``.

    A traceback is logged once per exception type (``logged`` remembers which);
    ``latency_s`` is slept first (a simulated slow reward).
    """
    if latency_s > 0:
        time.sleep(latency_s)
    try:
        r = float(fn(text, row))
    except Exception as e:  # noqa: BLE001 - a user reward must not kill the run; scored 0 and counted
        counts["reward_errors"] += 1
        kind = type(e).__name__
        if kind not in logged:
            logged.add(kind)
            log.error("reward function raised %s (scored 0; further %s errors are only counted):\n%s",
                      kind, kind, traceback.format_exc())
        return 0.0
    if r != r:  # NaN
        counts["reward_errors"] += 1
        return 0.0
    return r
