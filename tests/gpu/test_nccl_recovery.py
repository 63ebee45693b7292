"""An engine killed in the middle of a NCCL weight sync, on GPUs (issue 18, item d).

The trainer on one GPU, one vLLM engine on another (``cluster=gpu``), NCCL into the engine's
worker. At step 2 the engine's model process exits after two buckets of the next broadcast (a
fault point armed in vLLM's worker). The trainer's broadcast must fail with ``TransportError``
within ``transport.timeout_s`` (its communicator aborted, no hang, no watchdog kill), the engine is
declared dead, a replacement starts on the freed GPU, joins the rebuilt group with the version that
failed, and the run goes on with nothing lost. The same flow on gloo and CPU:
tests/integration/test_sole_engine_death.py.

Then the trainer's process exits in the middle of a NCCL sync: the run ends with the error that
says so and how to continue, and `disagg train resume=<run_dir>` finishes it from its checkpoint
(tests/integration/test_trainer_death.py on gloo).
"""

from __future__ import annotations

import pytest
import torch

from tests.recovery import (check_recovered, check_resumed_after_trainer_death, sole_engine_dies_mid_sync,
                            trainer_dies_mid_sync_then_resumes)

pytestmark = pytest.mark.gpu

TIMEOUT_S = 30.0


def test_an_engine_killed_mid_nccl_sync_is_replaced_and_nothing_is_lost(ray_session, model_cache, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (trainer and engine, one NCCL rank each), have {torch.cuda.device_count()}")
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from disagg.config import load_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        dc = compose(config_name="train", overrides=[
            "cluster=gpu", f"model.cache_dir={model_cache}", "model.warmstart.steps=30",
            "trainer.total_steps=20000", "algorithm.max_staleness=1", "rollout.num_engines=1",
            "rollout.health_interval_s=1.0", "rollout.health_timeout_s=20.0", "rollout.gpu_memory_utilization=0.3",
            # several buckets per sync, so the engine dies in the middle of one
            "transport.bucket_bytes=262144", f"transport.timeout_s={TIMEOUT_S}",
            "algorithm.group_size=4", "algorithm.prompts_per_step=8", "logging.progress=false"])
    cfg = load_config(OmegaConf.to_container(dc, resolve=True))
    assert cfg.transport.backend in ("auto", "nccl")
    out = sole_engine_dies_mid_sync(cfg, tmp_path / "run")
    failed = [e.message for e in out["final"].events if e.kind == "sync_failed"]
    print(f"sync failed: {failed[:1]}; replacement joined at version {out['pipeline'].join_version.get(1)}")
    check_recovered(out, TIMEOUT_S)


def test_the_trainer_killed_mid_nccl_sync_ends_the_run_clearly_and_it_resumes(model_cache, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (trainer and engine, one NCCL rank each), have {torch.cuda.device_count()}")
    args = ["cluster=gpu", f"model.cache_dir={model_cache}", "model.warmstart.steps=30", "algorithm.max_staleness=1",
            "algorithm.group_size=4", "algorithm.prompts_per_step=8", "rollout.gpu_memory_utilization=0.3",
            "transport.bucket_bytes=262144", f"transport.timeout_s={TIMEOUT_S}", "logging.progress=false"]
    out = trainer_dies_mid_sync_then_resumes(args, tmp_path / "run")
    died = [line for line in out["first_err"].splitlines() if "died during" in line]
    print(f"first run: exit {out['first_rc']}, {died[-1:]}; resumed: exit {out['rc']}, "
          f"steps {[r['step'] for r in out['records']]}")
    check_resumed_after_trainer_death(out)
