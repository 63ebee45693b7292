"""SGLang general-plugin hook (entry point group ``sglang.srt.plugins``, name ``disagg``: pyproject.toml).

SGLang runs every installed general plugin in its engine's process (``Engine.__init__``,
``entrypoints/engine.py:224``) and in each scheduler process before the scheduler is built
(``run_scheduler_process``, ``managers/scheduler.py:4895``; ``plugins/__init__.py:102-141``), unless
``SGLANG_PLUGINS`` names others. ``register`` puts ``hook.DisaggScheduler``'s methods on SGLang's
``Scheduler`` class, where the engine's collective RPC finds them by name."""

from __future__ import annotations

import inspect


def register() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    from disagg.rollout.sglang.hook import DisaggScheduler

    for name, fn in vars(DisaggScheduler).items():
        if inspect.isfunction(fn):
            setattr(Scheduler, name, fn)
