"""Experiment trackers: the backends of ``logging.backends`` besides ``metrics.jsonl``.

Each backend is one module behind ``Tracker``; each gets the same metric names (disagg's slash
paths), the same step numbers, the resolved config and the run directory. What is written by hand
is only the mapping from disagg's records to the trackers' calls (``scalars``, ``flatten``); the
libraries do the rest. A tracker's run id is kept in ``<run_dir>/trackers.json`` so that a resumed
run (``resume=``) continues the same tracker run. This module imports no tracker library: config
validation asks ``check_backends`` whether the chosen ones import.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Protocol

from disagg.errors import ConfigError

# backend -> (the package it imports, the disagg extra that installs it); jsonl is always written.
BACKENDS: dict[str, tuple[str | None, str | None]] = {
    "jsonl": (None, None),
    "tensorboard": (None, None),  # a dependency of disagg itself
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}

STATE_FILE = "trackers.json"


class Tracker(Protocol):
    name: str
    replaces_steps: bool
    """Whether logging a step the tracker already holds replaces it (TensorBoard's purge on resume).
    Where it does not, ``MetricsWriter`` leaves steps logged before a resume alone."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, failed: bool) -> None: ...


def check_backends(backends: tuple[str, ...], need_packages: bool) -> None:
    """Unknown names, and (``need_packages``) trackers whose package does not import, are ConfigErrors."""
    for name in backends:
        if name not in BACKENDS:
            raise ConfigError(f"logging.backends={list(backends)}: unknown backend {name!r} (known: "
                              f"{', '.join(BACKENDS)})")
        module, extra = BACKENDS[name]
        if need_packages and module is not None:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ConfigError(f"logging.backends={list(backends)}: {name!r} needs the {module} package, which "
                                  f"does not import ({e}): pip install 'disagg[{extra}]'") from e


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record, under their own names (booleans as 0/1; text and None left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``{"trainer": {"lr": 1e-5}}`` -> ``{"trainer.lr": 1e-5}``)."""
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def load_state(run_dir: Path) -> dict[str, dict[str, Any]]:
    path = run_dir / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def save_state(run_dir: Path, name: str, entry: dict[str, Any]) -> None:
    """Record tracker ``name``'s run (its id, where it lives) in ``<run_dir>/trackers.json``."""
    state = load_state(run_dir)
    state[name] = entry
    tmp = run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(run_dir / STATE_FILE)


def open_trackers(cfg, run_dir: Path, resume_step: int | None) -> list[Tracker]:
    """The trackers of ``cfg.logging.backends`` (jsonl is ``MetricsWriter``'s own), each continuing
    the tracker run recorded in the run directory when there is one."""
    config = {**cfg.to_dict(), "run_dir": str(run_dir)}
    state = load_state(run_dir)
    out: list[Tracker] = []
    for name in dict.fromkeys(cfg.logging.backends):
        if name == "tensorboard":
            from disagg.trackers.tensorboard_tracker import TensorBoardTracker

            out.append(TensorBoardTracker(run_dir, resume_step))
        elif name == "wandb":
            from disagg.trackers.wandb_tracker import WandbTracker

            out.append(WandbTracker(cfg.logging, run_dir, config, state.get(name)))
        elif name == "mlflow":
            from disagg.trackers.mlflow_tracker import MlflowTracker

            out.append(MlflowTracker(cfg.logging, run_dir, config, state.get(name), resume_step))
    return out
