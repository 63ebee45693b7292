"""Tasks: data sources and reward functions.

``base`` holds what every task uses (the reward registry, prompt sources, ``import_callable``) and
imports no task; each task module registers its rewards with it, and ``get_reward`` here imports
the built-in tasks when a reward is asked for by name.
"""

from __future__ import annotations

from disagg.errors import ConfigError
from disagg.tasks.base import RewardFn, import_callable, registered_rewards

BUILT_IN = ("disagg.tasks.reverse", "disagg.tasks.code", "disagg.tasks.calculator")
"""The modules whose rewards ``reward.name`` can name."""


def get_reward(name: str | None, path: str | None) -> RewardFn:
    """Resolve ``reward.name`` (registered) or ``reward.path`` (``module:function``)."""
    import importlib

    if path:
        return import_callable(path, "reward.path")
    for module in BUILT_IN:  # each registers its rewards when imported
        importlib.import_module(module)
    rewards = registered_rewards()
    if name not in rewards:
        raise ConfigError(f"reward.name={name!r} is not registered; known: {sorted(rewards)}")
    return rewards[name]
