"""Keep mode on a vLLM that labels no token (0.26 on the GPU machines): requests in flight are paused
across each sync, not aborted, and the engine cuts each response where vLLM's engine core counted
its tokens at the pause (``rollout.in_flight_at_sync=auto`` chooses keep there: the engine core
answers disagg's output counts). Each token must then replay as the
version it is tagged with, over the KV the earlier weights computed, as in resubmit mode
(``check_exact_token_versions``: a tag one token off at a pause would match a neighbouring
version's replay better than its own). Its own module: its engine would not fit beside the other
module's on one GPU."""

from __future__ import annotations

import pytest

from tests.gpu.test_vllm_engine import check_exact_token_versions, start_job

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def job(ray_session, model_cache, tmp_path_factory):
    j = start_job(model_cache, tmp_path_factory.mktemp("gpu-keep-run"), [
        "trainer.lr=3e-2", "rollout.max_model_len=2048", "model.tiny.max_position_embeddings=2048",
        "rollout.max_num_seqs=128", "rollout.in_flight_at_sync=auto"])
    yield j
    j.shutdown()


def test_kept_requests_are_cut_at_each_pause_with_exact_token_versions(job, tok):
    import ray

    info = job.rollout.start_info[0]
    assert (info["in_flight_at_sync"], info["token_version_sources"]) == ("keep", ["counts"])
    engine = job.rollout.engines[0]
    before = ray.get(engine.get_stats.remote(), timeout=60)
    check_exact_token_versions(job, tok)
    after = ray.get(engine.get_stats.remote(), timeout=60)
    assert after["resubmits"] == before["resubmits"]  # paused, never aborted
    assert after["counted_cuts"] - before["counted_cuts"] >= 2 * 2  # the request's 2 samples cut at 2 pauses or more
