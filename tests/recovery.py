"""Runs that fail in the middle: the only engine dying mid-sync, the trainer dying mid-sync (and the
resumed driver killed with SIGKILL): the flows and their checks, shared by the gloo tests on CPU
(tests/integration/test_sole_engine_death.py, test_trainer_death.py) and the NCCL ones on GPUs
(tests/gpu/test_nccl_recovery.py)."""

from __future__ import annotations

import time


def first_sync_and_pipeline(cfg, job, model_path, on_step):
    """Sync the initial weights as version 1 and make the pipeline of ``cfg`` on ``job``, whose steps
    call ``on_step`` (the fault-injection runs steer the job from it)."""
    from transformers import AutoTokenizer

    from disagg.train import make_pipeline

    job.sync_weights(1, trainer_step=0)
    return make_pipeline(cfg, job, AutoTokenizer.from_pretrained(model_path), on_step=on_step)


def sole_engine_dies_mid_sync(cfg, run_dir, stop_after_s: float = 900.0) -> dict:
    """Run ``cfg`` (one engine, staleness >= 1); at step 2 the engine's process exits after two
    buckets of the next sync's broadcast; stop once the replacement served and trained groups."""
    import ray

    from disagg.control.client import CoordinatorClient
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    model_path = prepare_model(cfg)
    job = Job.start(cfg, run_dir, model_path)
    client = CoordinatorClient(job.coordinator.address, timeout_s=30, token=job.token)
    armed: dict = {}

    def on_step(step: int, rec: dict) -> None:
        if pipeline.stopped is not None or "stop" in armed:
            return  # the steps in progress when the stop came still finish
        if not armed and step == 2:
            armed.update(step=step, t=time.time())
            ray.get(job.rollout.handle(0).arm_fault.remote("receive_bucket", "exit", 2))
        elif armed and 1 in pipeline.serving and pipeline.trained_by_engine[1] >= 2:
            armed["stop"] = step
            client.stop("test done")
        elif time.time() - t0 > stop_after_s:
            armed["stop"] = step
            client.stop("test timed out")

    try:
        pipeline = first_sync_and_pipeline(cfg, job, model_path, on_step)
        t0 = time.time()
        records = pipeline.run(cfg.trainer.total_steps)
        return {"pipeline": pipeline, "records": records, "armed": armed, "final": client.status()}
    finally:
        client.close()
        job.shutdown()


def check_recovered(out: dict, timeout_s: float) -> None:
    """What must hold after the sole engine died mid-sync (shared with the GPU test)."""
    records, pipeline, final = out["records"], out["pipeline"], out["final"]
    assert pipeline.stopped == "test done", (pipeline.stopped, out["armed"])
    last = records[-1]
    assert last["rollout/engine_deaths"] == 1 and last["rollout/engines_replaced"] == 1
    # One sync failed, the one the engine died in; it was not sent into a group with nobody in it
    # (that would count as a second failure) but waited for the replacement.
    assert last["transport/sync_failures"] == 1 and last["transport/sync_retries"] == 1
    assert last["rollout/num_engines"] == 1
    # The failure surfaced as a TransportError within the transport timeout: no hang.
    failed = [e for e in final.events if e.kind == "sync_failed"]
    assert failed, [e.kind for e in final.events]
    assert failed[0].unix_s - out["armed"]["t"] <= timeout_s + 60, (failed[0].unix_s - out["armed"]["t"])
    # The replacement joined the rebuilt group with the version that failed and trained from then
    # on; nothing was lost or skipped.
    failed_version = int(failed[0].message.split(":")[0].removeprefix("version "))
    assert pipeline.join_version[1] == failed_version
    assert pipeline.first_trained_version[1] >= pipeline.join_version[1]
    versions = [r["policy_version"] for r in records]
    assert versions == list(range(versions[0], versions[0] + len(versions)))
    assert all(r["rollout/prompts_lost"] == 0 and r["rollout/dummy_served"] == 0 for r in records)
    assert all(r["samples/trained_beyond_staleness"] == 0 for r in records)
    assert pipeline.prompts_lost() == 0


def buckets_per_sync(overrides: list[str]) -> int:
    """How many buckets one sync of the job ``disagg train OVERRIDES`` sends (the model built on the
    meta device, its manifest planned as the trainer plans it)."""
    from pathlib import Path

    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from disagg.config import load_config
    from disagg.model.tiny import build_model
    from disagg.transport.model_transfer import model_manifest

    configs = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = load_config(OmegaConf.to_container(compose(config_name="train", overrides=overrides), resolve=True))
    with torch.device("meta"):
        model = build_model(cfg.model.tiny, seed=0)
    t = cfg.transport
    return len(model_manifest(model, t.bucket_bytes, 0, t.dtype, t.first_bucket_bytes).buckets)


def trainer_dies_mid_sync_then_resumes(args: list[str], run_dir, timeout_s: float = 900.0,
                                       kill_the_resumed_driver: bool = False) -> dict:
    """``disagg train ARGS`` (8 steps, a checkpoint every 2) whose trainer process exits in the
    middle of the weight sync of version 6, the one after step 5, half its buckets sent (the
    ``send_bucket`` fault point, through ``DISAGG_FAULTS``); then ``disagg train ARGS resume=RUN_DIR``
    finishes the run from the checkpoint of step 4. With ``kill_the_resumed_driver`` the first
    resumed run's driver is killed with SIGKILL right after its first checkpoint
    (``driver_killed_after_checkpoint``) and a second ``resume=`` finishes the run from there.
    Returns the runs' exit codes and stderr and the run's records."""
    import json

    from disagg import faults
    from tests.conftest import disagg_process

    args = [*args, "trainer.total_steps=8", "trainer.checkpoint_every=2", f"hydra.run.dir={run_dir}"]
    per_sync = buckets_per_sync([a for a in args if not a.startswith(("hydra.", "model.cache_dir"))])
    # Versions 1..5 go out whole (the initial weights, then steps 1-4), then half of version 6.
    fire_at = 5 * per_sync + max(1, per_sync // 2)
    first = disagg_process(["train", *args], env={faults.ENV: f"send_bucket:exit:{fire_at}"})
    _, first_err = first.communicate(timeout=timeout_s)
    killed = (driver_killed_after_checkpoint(["train", *args, f"resume={run_dir}"], run_dir, 1, timeout_s)
              if kill_the_resumed_driver else None)
    second = disagg_process(["train", *args, f"resume={run_dir}"])
    _, second_err = second.communicate(timeout=timeout_s)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumes = [json.loads(x) for x in (run_dir / "resume.jsonl").read_text().splitlines()]
    return {"first_rc": first.returncode, "first_err": first_err, "rc": second.returncode, "err": second_err,
            "records": records, "resumes": resumes, "buckets_per_sync": per_sync, "killed": killed}


def driver_killed_after_checkpoint(cmd: list[str], run_dir, nth: int, timeout_s: float) -> dict:
    """``disagg CMD`` whose driver freezes itself (SIGSTOP, the ``checkpoint_written`` fault point)
    right after its ``nth`` checkpoint - in the middle of the run however fast the run and however
    slow this poll - and is then killed with SIGKILL, as an OOM killer or a lost node would. Returns
    its exit code, the steps recorded and the checkpoints on disk when it died."""
    import json
    import signal
    from pathlib import Path

    from disagg import faults
    from tests.conftest import disagg_process

    def stopped(pid: int) -> bool:  # its state in /proc is T
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

    proc = disagg_process(cmd, env={faults.ENV: f"checkpoint_written:stop:{nth}"})
    try:
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and not stopped(proc.pid):
            assert time.monotonic() < deadline, f"the driver did not stop after checkpoint {nth}"
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"rc": proc.returncode,
            "steps": [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()],
            "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir())}


def check_resumed_after_trainer_death(out: dict) -> None:
    """What must hold after the trainer died mid-sync and the run was resumed (shared with the GPU test)."""
    assert out["first_rc"] != 0, out["first_err"][-3000:]
    # The run ended with the error that says what happened and how to go on, not with a hang.
    died = [line for line in out["first_err"].splitlines() if "died during" in line and "resume=" in line]
    assert died, out["first_err"][-3000:]
    assert "version 6" in died[-1] or "train step" in died[-1], died[-1]
    assert out["rc"] == 0, out["err"][-4000:]
    records = out["records"]
    # One record per step, 1..8, versions continuous: the steps after the checkpoint of step 4 ran again.
    assert [r["step"] for r in records] == list(range(1, 9)), [r["step"] for r in records]
    assert [r["policy_version"] for r in records] == list(range(2, 10))
    # Resumed from the checkpoint of step 4 (then, where the resumed driver was killed, from its own).
    killed = [int(out["killed"]["checkpoints"][-1].removeprefix("step_"))] if out.get("killed") else []
    assert [r["step"] for r in out["resumes"]] == [4, *killed], out["resumes"]
    after = [r for r in records if r["step"] > 4]
    assert all(r["rollout/prompts_lost"] == 0 and r["rollout/dummy_served"] == 0 for r in after)
    assert all(r["samples/trained_beyond_staleness"] == 0 for r in after)
