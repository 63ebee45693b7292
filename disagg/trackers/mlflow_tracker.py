"""An MLflow run (``logging.backends`` entry ``mlflow``; ``pip install 'disagg[mlflow]'``).

The tracking URI is ``logging.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a SQLite
store in the run directory (``sqlite:///<run_dir>/mlflow.db``, artifacts in
``<run_dir>/mlflow-artifacts``; ``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``
shows it). The experiment is ``logging.project``. The resolved config is logged as params (flattened,
values cut at MLflow's length limit) and whole as the artifact ``config.json``; the run directory is
the tag ``disagg.run_dir``. A resumed disagg run continues the MLflow run recorded in
``trackers.json`` (params are immutable in MLflow: a resume logs its config as
``config-resume-step<N>.json`` instead).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from disagg.trackers import flatten, save_state

log = logging.getLogger("disagg.trackers")


def tracking_uri(configured: str | None, run_dir: Path) -> tuple[str, bool]:
    """(the tracking URI, whether it is the default store in the run directory)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    return (uri, False) if uri else (f"sqlite:///{run_dir.resolve() / 'mlflow.db'}", True)


def params(config: dict[str, Any], max_len: int) -> dict[str, str]:
    """The config as MLflow params: dotted keys, values as text of at most ``max_len`` characters."""
    return {k: str(v)[:max_len] for k, v in flatten(config).items()}


class MlflowTracker:
    name = "mlflow"
    replaces_steps = False  # MLflow keeps every value logged at a step

    def __init__(self, cfg, run_dir: Path, config: dict[str, Any], previous: dict[str, Any] | None,
                 resume_step: int | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.utils.validation import (
            MAX_PARAM_VAL_LENGTH,
            MAX_PARAMS_TAGS_PER_BATCH,
        )

        self.uri, in_run_dir = tracking_uri(cfg.mlflow_tracking_uri, run_dir)
        self._client = MlflowClient(self.uri)
        if previous:
            self.run_id = previous["run_id"]
            self._client.update_run(self.run_id, status="RUNNING")
            self._client.log_dict(self.run_id, config, f"config-resume-step{resume_step}.json")
        else:
            exp = self._client.get_experiment_by_name(cfg.project)
            artifacts = (run_dir.resolve() / "mlflow-artifacts").as_uri() if in_run_dir else None
            exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(
                cfg.project, artifact_location=artifacts)
            run = self._client.create_run(exp_id, run_name=cfg.run_name or run_dir.name,
                                          tags={"disagg.run_dir": str(run_dir)})
            self.run_id = run.info.run_id
            flat = [Param(k, v) for k, v in params(config, MAX_PARAM_VAL_LENGTH).items()]
            for i in range(0, len(flat), MAX_PARAMS_TAGS_PER_BATCH):
                self._client.log_batch(self.run_id, params=flat[i:i + MAX_PARAMS_TAGS_PER_BATCH])
            self._client.log_dict(self.run_id, config, "config.json")
        save_state(run_dir, self.name, {"run_id": self.run_id, "tracking_uri": self.uri})
        log.info("mlflow run %s at %s", self.run_id, self.uri)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v in metrics.items()])

    def close(self, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
