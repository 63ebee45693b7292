"""`disagg train resume=<run_dir>` as a user runs it (subprocesses: real Ray, vLLM, gloo): a run
with periodic checkpoints on one trainer worker, resumed on two FSDP2 workers for more steps;
and a checkpoint of two FSDP2 workers resumed on one (trainer actors only).

The same two runs log to `logging.backends=[jsonl,wandb,mlflow]`, with wandb offline and MLflow's
store in the run directory: the trackers' histories are read back and compared with metrics.jsonl,
after the first run and after the resumed one (one pair of runs serves both properties: the suite
starts two `disagg train` processes here instead of four)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SMALL_CLI, disagg_process, small_config
from tests.tracker_history import mlflow_history, wandb_history

PROMPTS_PER_STEP = 4  # SMALL_CLI; with max_staleness=0 every step draws exactly this many prompts


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(args, run_dir, model_cache, env):
    proc = disagg_process(["train", *SMALL_CLI, *args, "logging.backends=[jsonl,wandb,mlflow]",
                           f"model.cache_dir={model_cache}", f"hydra.run.dir={run_dir}"], env=env)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    return out + err


def _trackers(run_dir, wandb_dir) -> dict | Exception:
    """trackers.json, and the reward/mean history each tracker holds now (step -> value). A failure
    to read them is returned, not raised: it fails the trackers' test, not every resume test."""
    try:
        ids = json.loads((run_dir / "trackers.json").read_text())
        wb = wandb_history(wandb_dir, ids["wandb"]["run_id"])
        return {"ids": ids, "wandb": wb, "wandb_reward": {s: h["reward/mean"] for s, h in wb.items()},
                "mlflow_reward": mlflow_history(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"],
                                                "reward/mean")}
    except Exception as e:  # noqa: BLE001 - re-raised by the trackers' test
        return e


def _optimizer_digest(path):
    """(Adam step, sum of |exp_avg|, scheduler epoch, world size) of a checkpoint's optimizer.pt."""
    import torch

    saved = torch.load(path / "optimizer.pt", weights_only=True)
    state = saved["optimizer"]["state"].values()
    return (max(int(s["step"]) for s in state), sum(float(s["exp_avg"].double().abs().sum()) for s in state),
            saved["scheduler"]["last_epoch"], saved["world_size"])


def _weight_sum(path) -> float:
    from safetensors.torch import load_file

    return sum(float(t.double().sum()) for t in load_file(path / "model.safetensors").values())


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, model_cache):
    """Steps 1-3 on one worker (checkpoints after step 2 and after the last step, one kept), then
    ``resume=<run_dir>`` on two FSDP2 workers up to step 5; wandb (offline) and MLflow log both."""
    tmp = tmp_path_factory.mktemp("resume")
    run_dir = tmp / "run"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}
    every = ["trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]
    log_a = _train(["trainer.total_steps=3", "trainer.num_workers=1", *every], run_dir, model_cache, env)
    ckpt = run_dir / "checkpoints" / "step_000003"
    before = {"records": _records(run_dir), "state": json.loads((ckpt / "state.json").read_text()),
              "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
              "optimizer": _optimizer_digest(ckpt), "weights": _weight_sum(ckpt), "log": log_a,
              "trackers": _trackers(run_dir, tmp)}
    log_b = _train([f"resume={run_dir}", "trainer.total_steps=5", "trainer.num_workers=2", *every], run_dir,
                   model_cache, env)
    before["trackers_resumed"] = _trackers(run_dir, tmp)
    return run_dir, before, log_b


def test_the_first_run_checkpoints_every_n_steps_and_after_its_last(resumed_run):
    run_dir, before, _ = resumed_run
    assert "checkpoint of step 2 (policy version 3)" in before["log"]
    assert before["checkpoints"] == ["step_000003"]  # step 2 pruned (trainer.keep_checkpoints=1)
    st = before["state"]
    assert (st["step"], st["policy_version"]) == (3, 4)
    assert st["data_cursor"] == 3 * PROMPTS_PER_STEP and st["data_pending"] == []
    assert before["optimizer"][0] == 3 and before["optimizer"][2:] == (3, 1)  # Adam step, scheduler epoch, workers


def test_the_resumed_run_continues_steps_versions_and_metrics(resumed_run):
    run_dir, before, _ = resumed_run
    recs = _records(run_dir)
    assert recs[:3] == before["records"]  # appended to, not rewritten
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in recs] == [2, 3, 4, 5, 6]
    assert all(r["rollout/prompts_lost"] == 0 for r in recs)  # the resumed pipeline's accounting holds too
    assert recs[3]["policy/version_trained"] == before["state"]["policy_version"]
    entry = json.loads((run_dir / "resume.jsonl").read_text())
    assert (entry["step"], entry["policy_version"]) == (3, 4)
    assert (entry["num_trainer_workers_saved"], entry["num_trainer_workers"]) == (1, 2)
    assert entry["config_changes"]["trainer.num_workers"] == [1, 2]
    assert entry["config_changes"]["trainer.total_steps"] == [3, 5]


def test_the_two_resumed_workers_start_from_the_checkpoint(resumed_run):
    run_dir, before, log = resumed_run
    loaded = json.loads((run_dir / "resume.jsonl").read_text())["trainer"]
    # Weights: the sharded trainer holds the checkpoint's, not the base model's.
    assert loaded["param_checksum"] == pytest.approx(before["weights"], rel=1e-9)
    assert abs(_weight_sum(Path(before["state"]["base_model_path"])) - before["weights"]) > 1e-3
    # The engines served those weights from the first request: the resumed step's behaviour
    # log-probs are the trainer's own (a sample of other weights would show a KL).
    assert _records(run_dir)[3]["train/kl_behaviour"] < 1e-4
    # Optimizer and scheduler: Adam's moments and step count, as saved.
    step, exp_avg, _, _ = before["optimizer"]
    assert loaded["optimizer_step"] == step
    assert loaded["exp_avg_abs_sum"] == pytest.approx(exp_avg, rel=1e-9)


def test_the_resumed_run_trains_on_and_checkpoints_with_the_new_pool(resumed_run):
    run_dir, before, _ = resumed_run
    # The resumed-from checkpoint stays while the run uses it; step 4 was pruned after step 5.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000003", "step_000005"]
    final = run_dir / "checkpoints" / "step_000005"
    step, _, epoch, workers = _optimizer_digest(final)
    assert (step, epoch, workers) == (5, 5, 2)  # 3 steps before the resume + 2 after
    st = json.loads((final / "state.json").read_text())
    # The prompts went on from where the first run stopped (not from row 0 again).
    assert st["data_cursor"] == 5 * PROMPTS_PER_STEP


def test_wandb_and_mlflow_get_every_step_and_a_resumed_run_continues_them(resumed_run):
    run_dir, before, _ = resumed_run
    for read in (before["trackers"], before["trackers_resumed"]):
        if isinstance(read, Exception):
            raise read
    first = before["trackers"]
    assert first["ids"]["mlflow"]["tracking_uri"] == f"sqlite:///{run_dir.resolve()}/mlflow.db"
    recs = before["records"]
    reward = {r["step"]: r["reward/mean"] for r in recs}
    assert sorted(reward) == [1, 2, 3]
    assert first["mlflow_reward"] == reward
    assert first["wandb_reward"] == reward
    # every metric of the step (the JSONL's own `step` and wall-clock stamp are not metrics)
    assert set(first["wandb"][1]) == {k for k, v in recs[0].items()
                                      if k not in ("step", "time_unix_s") and isinstance(v, (int, float))}

    resumed = before["trackers_resumed"]
    assert resumed["ids"] == first["ids"]  # the same wandb and MLflow runs
    reward = {r["step"]: r["reward/mean"] for r in _records(run_dir)}
    assert sorted(reward) == [1, 2, 3, 4, 5]
    assert resumed["mlflow_reward"] == reward
    assert resumed["wandb_reward"] == reward
    print("tracker reward/mean by step:", reward)


def test_a_checkpoint_of_two_fsdp_workers_resumes_in_one(ray_session, model_cache, tmp_path):
    """The continuation after a resume equals the uninterrupted run: one more step from the
    loaded state moves the weights exactly as the two workers' next step did."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from disagg.model.warmstart import prepare_model
    from disagg.samples import TrainSample
    from disagg.trainer.pool import TrainerGroup

    samples = [TrainSample([1, 5 + i, 9], [7, 8 + i, 6, 2], [-2.0, -2.5, -1.0, -3.0], 1.0 if i % 2 else -1.0, 0.0, 1)
               for i in range(8)]

    def group(n, model_path):
        cfg = small_config(model_cache, trainer={"num_workers": n, "warmup_steps": 4})
        pg = placement_group([{"CPU": 1}] * n)
        ray_session.get(pg.ready(), timeout=120)
        return TrainerGroup(cfg, pg, "cpu", str(model_path)), pg

    two, pg = group(2, prepare_model(small_config(model_cache)))
    try:
        two.train_step(samples)
        two.train_step(samples)
        two.save_checkpoint(str(tmp_path / "ckpt"))
        saved = {**two.optimizer_summary(), "param_checksum": two.param_checksum()}
        two.train_step(samples)
        expected = two.param_checksum()
    finally:
        two.shutdown()
        remove_placement_group(pg)
    one, pg = group(1, tmp_path / "ckpt")
    try:
        loaded = one.load_checkpoint(str(tmp_path / "ckpt"))
        assert loaded["optimizer_step"] == saved["optimizer_step"] == 2
        assert loaded["lr"] == saved["lr"]  # mid warm-up: the scheduler's position matters
        assert loaded["exp_avg_abs_sum"] == pytest.approx(saved["exp_avg_abs_sum"], rel=1e-9)
        assert loaded["param_checksum"] == pytest.approx(saved["param_checksum"], rel=1e-12)
        one.train_step(samples)
        assert one.param_checksum() == pytest.approx(expected, rel=1e-9)
    finally:
        one.shutdown()
        remove_placement_group(pg)
