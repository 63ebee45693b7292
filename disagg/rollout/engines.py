"""Which inference engine the engine actors run (``rollout.engine``), in one place.

Each engine is a package of its own (``rollout/vllm/``, ``rollout/sglang/``) with an
``EngineBackend`` (``rollout/backend.py``) and a function that gives the engine actor's process its
environment. The pool asks here for that environment, the engine actor for the backend class: both
by import path, so that this module - and the driver that imports it - imports no engine.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from disagg.config import RolloutConfig


@dataclass(frozen=True)
class EngineSpec:
    """One engine as the rollout package starts it."""

    backend: str
    """'module:Class' of its ``EngineBackend`` (a ``start(cfg, model_path, seed)`` classmethod)."""
    env: str
    """'module:function' ``(device, cfg, bundle_indices) -> dict``: the engine actor's environment
    variables, which the engine's own processes inherit."""
    log_level_env: str | None
    """The variable that takes ``rollout.vllm_log_level``; None where the backend passes the level
    to the engine as an argument instead (SGLang's ``log_level``)."""


ENGINES: dict[str, EngineSpec] = {
    "vllm": EngineSpec("disagg.rollout.vllm.backend:VllmBackend", "disagg.rollout.vllm.api:actor_env",
                       "VLLM_LOGGING_LEVEL"),
    "sglang": EngineSpec("disagg.rollout.sglang.backend:SglangBackend", "disagg.rollout.sglang.backend:actor_env",
                         None),
}


def _attr(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def spec(engine: str) -> EngineSpec:
    """``rollout.engine``'s entry (the config's ``Literal`` keeps other names out)."""
    return ENGINES[engine]


def backend_class(engine: str) -> type:
    """The ``EngineBackend`` class of ``engine``, imported (in the engine actor's process)."""
    return _attr(spec(engine).backend)


def actor_env(cfg: RolloutConfig, device: str, bundle_indices: list[int]) -> dict[str, str]:
    """The environment of an engine actor of ``cfg.engine`` on ``device`` whose engine sits on the
    placement group's ``bundle_indices``."""
    s = spec(cfg.engine)
    env = dict(_attr(s.env)(device, cfg, bundle_indices))
    if s.log_level_env is not None:
        env[s.log_level_env] = cfg.vllm_log_level
    return env
