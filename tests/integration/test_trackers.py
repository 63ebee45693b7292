"""`disagg train logging.backends=[jsonl,wandb,mlflow]` as a user runs it (a subprocess: real Ray,
vLLM, gloo), with wandb offline and MLflow's store in the run directory; then `resume=` for two
more steps. The trackers' histories are read back and compared with metrics.jsonl."""

from __future__ import annotations

import json

from tests.conftest import SMALL_CLI, disagg_process
from tests.tracker_history import mlflow_history, wandb_history


def _train(args, run_dir, model_cache, env):
    proc = disagg_process(["train", *SMALL_CLI, *args, "logging.backends=[jsonl,wandb,mlflow]",
                           "trainer.checkpoint_every=3", f"model.cache_dir={model_cache}", f"hydra.run.dir={run_dir}"],
                          env=env)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    return json.loads((run_dir / "trackers.json").read_text())


def test_wandb_and_mlflow_get_every_step_and_a_resumed_run_continues_them(tmp_path, model_cache):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}
    run_dir = tmp_path / "run"
    first = _train(["trainer.total_steps=3"], run_dir, model_cache, env)
    uri = first["mlflow"]["tracking_uri"]
    assert uri == f"sqlite:///{run_dir.resolve()}/mlflow.db"
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reward = {r["step"]: r["reward/mean"] for r in recs}
    assert sorted(reward) == [1, 2, 3]
    assert mlflow_history(uri, first["mlflow"]["run_id"], "reward/mean") == reward
    wb = wandb_history(tmp_path, first["wandb"]["run_id"])
    assert {s: h["reward/mean"] for s, h in wb.items()} == reward
    assert set(wb[1]) == {k for k, v in recs[0].items() if k != "step" and isinstance(v, (int, float))}

    resumed = _train([f"resume={run_dir}", "trainer.total_steps=5"], run_dir, model_cache, env)
    assert resumed == first  # the same wandb and MLflow runs
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reward = {r["step"]: r["reward/mean"] for r in recs}
    assert sorted(reward) == [1, 2, 3, 4, 5]
    assert mlflow_history(uri, first["mlflow"]["run_id"], "reward/mean") == reward
    assert {s: h["reward/mean"] for s, h in wandb_history(tmp_path, first["wandb"]["run_id"]).items()} == reward
    print("tracker reward/mean by step:", reward)
