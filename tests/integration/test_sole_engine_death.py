"""The only engine dies in the middle of a weight sync (real Ray, vLLM on CPU, gloo).

With one engine, nobody is left to receive the version that failed: the sync must not go into a
transport group with nobody in it. It waits for the replacement, which joins the rebuilt group
with that very version, and the run goes on with nothing lost. tests/gpu/test_nccl_recovery.py
runs the same flow (tests/recovery.py) over NCCL into vLLM's worker.
"""

from __future__ import annotations

from tests.conftest import small_config
from tests.recovery import check_recovered, sole_engine_dies_mid_sync

TIMEOUT_S = 20.0  # transport.timeout_s: the sync must fail within it


def test_the_only_engine_dying_mid_sync_is_replaced_and_gets_that_version(ray_session, model_cache, tmp_path):
    cfg = small_config(model_cache, trainer={"total_steps": 20_000}, algorithm={"max_staleness": 1},
                       rollout={"num_engines": 1, "health_interval_s": 1.0, "health_timeout_s": 10.0},
                       transport={"bucket_bytes": 256 * 1024, "timeout_s": TIMEOUT_S})
    check_recovered(sole_engine_dies_mid_sync(cfg, tmp_path / "run"), TIMEOUT_S)
