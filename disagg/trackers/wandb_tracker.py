"""A Weights & Biases run (``logging.backends`` entry ``wandb``; ``pip install 'disagg[wandb]'``).

Online needs a login (``wandb login`` or ``WANDB_API_KEY``); ``logging.wandb_mode=offline`` (or
``WANDB_MODE=offline``) writes the run under ``WANDB_DIR`` (default: the run directory) for a later
``wandb sync``. A resumed disagg run continues the wandb run recorded in ``trackers.json``
(``id=..., resume="allow"``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from disagg.trackers import save_state

log = logging.getLogger("disagg.trackers")


class WandbTracker:
    name = "wandb"
    replaces_steps = False  # wandb ignores a step at or below the run's last one

    def __init__(self, cfg, run_dir: Path, config: dict[str, Any], previous: dict[str, Any] | None):
        import wandb

        self._run = wandb.init(
            project=cfg.project, name=cfg.run_name or run_dir.name, config=config, mode=cfg.wandb_mode,
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            id=previous["run_id"] if previous else None, resume="allow" if previous else None)
        save_state(run_dir, self.name, {"run_id": self._run.id, "project": cfg.project})
        log.info("wandb run %s (%s)", self._run.id, self._run.url or f"offline: {self._run.dir}")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
