"""The trainer dies in the middle of a weight sync (real Ray, vLLM on CPU, gloo), then the run is
resumed from its checkpoint.

`disagg train` runs with a checkpoint every 2 steps; its trainer process exits (``os._exit``, as a
crash would) after sending half the buckets of the sync that follows step 5. The run must end with
the error that names what died and the command that continues it, within the transport timeout
(no hang), and `disagg train resume=<run_dir>` must finish it from the checkpoint of step 4 with
steps and versions continuous, nothing lost and nothing trained beyond the staleness limit.
tests/gpu/test_nccl_recovery.py runs the same flow (tests/recovery.py) over NCCL.
"""

from __future__ import annotations

from tests.conftest import SMALL_CLI
from tests.recovery import check_resumed_after_trainer_death, trainer_dies_mid_sync_then_resumes


def test_the_trainer_dying_mid_sync_ends_the_run_clearly_and_it_resumes_from_its_checkpoint(model_cache, tmp_path):
    args = [*SMALL_CLI, "algorithm.max_staleness=1", f"model.cache_dir={model_cache}",
            "transport.bucket_bytes=262144", "transport.timeout_s=20"]
    out = trainer_dies_mid_sync_then_resumes(args, tmp_path / "run")
    assert out["buckets_per_sync"] >= 4  # the trainer dies with buckets sent and buckets to send
    check_resumed_after_trainer_death(out)
