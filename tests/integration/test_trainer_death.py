"""The trainer dies in the middle of a weight sync (real Ray, vLLM on CPU, gloo), the run is resumed
from its checkpoint, the resumed run's driver is killed with SIGKILL, and the run is resumed again.

`disagg train` runs with a checkpoint every 2 steps; its trainer process exits (``os._exit``, as a
crash would) after sending half the buckets of the sync that follows step 5. The run must end with
the error that names what died and the command that continues it, within the transport timeout
(no hang). `disagg train resume=<run_dir>` continues from the checkpoint of step 4; its driver
freezes itself right after its first checkpoint (step 6, a fault point, so that the run cannot end
first) and is killed with SIGKILL; `disagg train resume=<run_dir>` again finishes the run from that
checkpoint, with steps and versions continuous, nothing lost and nothing trained beyond the
staleness limit. One chain of three `disagg train` processes serves both failures.
tests/gpu/test_nccl_recovery.py runs the trainer's death (tests/recovery.py) over NCCL.
"""

from __future__ import annotations

import signal

import pytest

from tests.conftest import SMALL_CLI
from tests.recovery import check_resumed_after_trainer_death, trainer_dies_mid_sync_then_resumes


@pytest.fixture(scope="module")
def chain(model_cache, tmp_path_factory):
    args = [*SMALL_CLI, "algorithm.max_staleness=1", f"model.cache_dir={model_cache}",
            "transport.bucket_bytes=262144", "transport.timeout_s=20"]
    return trainer_dies_mid_sync_then_resumes(args, tmp_path_factory.mktemp("trainer-death") / "run",
                                              kill_the_resumed_driver=True)


def test_the_trainer_dying_mid_sync_ends_the_run_clearly_and_it_resumes_from_its_checkpoint(chain):
    assert chain["buckets_per_sync"] >= 4  # the trainer dies with buckets sent and buckets to send
    check_resumed_after_trainer_death(chain)


def test_a_driver_killed_with_sigkill_resumes_from_its_checkpoint(chain):
    killed = chain["killed"]
    assert killed["rc"] == -signal.SIGKILL
    # Killed in the middle: after the checkpoint of step 6 (the first of the resumed run), before step 8.
    assert killed["checkpoints"][-1] == "step_000006", killed
    assert 6 <= max(killed["steps"]) < 8, killed
    # The last resume went on from there: every step once, versions continuous, nothing lost.
    records = chain["records"]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["policy_version"] for r in records] == list(range(2, 10))
    assert all(r["rollout/prompts_lost"] == 0 and r["rollout/dummy_served"] == 0 for r in records[6:])
    assert all(r["samples/trained_beyond_staleness"] == 0 for r in records[6:])
    assert [r["step"] for r in chain["resumes"]] == [4, 6]
