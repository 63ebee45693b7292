"""The asynchronous pipeline on real parts: Ray, a vLLM engine, gloo weight syncs
while generation goes on, reward worker actors, the gRPC coordinator.

One Job (1 trainer + 1 engine) is shared by the module; policy versions keep
rising across the tests, in file order.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from disagg.rollout.types import GenRequest, SamplingSpec
from disagg.samples import TrainSample
from tests.conftest import (a_sync_stops_what_no_step_can_train, long_request_across_syncs, next_step_held_until,
                            replay_logprobs, small_config)

LONG_TOKENS = 200


@pytest.fixture(scope="module")
def job(ray_session, model_cache, tmp_path_factory):
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    # A large learning rate: every step visibly changes the policy, so a token's
    # log-prob tells which version's weights produced it.
    cfg = small_config(model_cache, trainer={"lr": 3e-2, "grad_clip": 0.0},
                       rollout={"max_model_len": 240, "max_tokens": 8, "max_num_seqs": 128},
                       reward={"num_workers": 2})
    j = Job.start(cfg, tmp_path_factory.mktemp("async-run"), prepare_model(cfg))
    yield j
    j.shutdown()


def _next_version(job) -> int:
    return job.coordinator.state.latest_version() + 1


def test_a_push_from_a_snapshot_sends_its_version_while_the_next_step_trains(job, tok):
    """transport.overlap_push: the push of version v+1 reads the copy its train step took, on the
    trainer's transport thread, while the next step changes the live weights. First in the module:
    later tests train the policy into saturation, where a step no longer moves greedy log-probs."""
    import ray

    assert job.trainer.overlap_push  # the default, with one trainer worker
    v = _next_version(job)
    job.sync_weights(v, trainer_step=v)
    prompt = [tok.bos_token_id] + tok.encode("98765=", add_special_tokens=False)
    greedy = SamplingSpec(max_tokens=8, greedy=True, ignore_eos=True)
    engine = job.rollout.engines[0]
    (res,) = ray.get(engine.generate.remote([GenRequest("snap0", tuple(prompt), greedy)]), timeout=120)
    response = res.completions[0].response_ids

    def on_policy(advantage: float) -> list[TrainSample]:
        """The greedy response with the trainer's own log-probs: nothing is clipped, every step moves."""
        probe = TrainSample(prompt, response, [0.0] * len(response), advantage, 0.0, v)
        (lp,) = ray.get(job.trainer.rank0.logprobs.remote([probe]), timeout=120)
        return [TrainSample(prompt, response, lp, advantage, 0.0, v)] * 4

    ray.get(job.trainer.train_step_async(on_policy(1.0), snapshot_version=v + 1), timeout=120)
    made = ray.get(job.trainer.rank0.full_state_dict.remote(), timeout=120)  # the weights of v + 1
    job.trainer.announce(job.control_client(), v + 1, v + 1)
    push = job.trainer.push_weights_async(v + 1, from_snapshot=True)
    # No engine receives yet, so the push waits for its receiver; the next step (the response
    # pushed down) trains meanwhile, on the trainer's other thread.
    ray.get(job.trainer.train_step_async(on_policy(-1.0), snapshot_version=v + 2), timeout=120)
    assert not ray.wait(push, timeout=0)[0], "the push finished without a receiver"
    live = ray.get(job.trainer.rank0.full_state_dict.remote(), timeout=120)
    ray.get(push + job.rollout.receive_weights_async(v + 1), timeout=120)
    assert job.coordinator.state.committed_version() == v + 1

    # The engine serves exactly the snapshot: its greedy log-probs are those of v + 1's weights.
    (res,) = ray.get(engine.generate.remote([GenRequest("snap1", tuple(prompt), greedy)]), timeout=120)
    c = res.completions[0]
    assert set(c.token_versions) == {v + 1}
    got = torch.tensor(c.logprobs)
    err = (replay_logprobs(job.model_path, {v + 1: made}, prompt, c.response_ids, [v + 1] * 8)
           - got).abs().max().item()
    assert err < 2e-3, err
    wrong = (replay_logprobs(job.model_path, {v + 1: live}, prompt, c.response_ids, [v + 1] * 8)
             - got).abs().max().item()
    assert wrong > 1e-2, wrong  # the live weights (after the next step) would not match

    timeline = ray.get(job.trainer.rank0.timeline.remote(), timeout=60)
    (pushed,) = [(a, b) for what, ver, a, b in timeline if what == "push" and ver == v + 1]
    (trained,) = [(a, b) for what, ver, a, b in timeline if what == "train" and ver == v + 2]
    assert trained[1] < pushed[1]  # the next step ended while the push was still going on


def test_partial_rollouts_continue_across_several_weight_updates(job, tok):
    import ray

    prompt = [tok.bos_token_id] + tok.encode("4321=", add_special_tokens=False)
    engine = job.rollout.engines[0]
    before = ray.get(engine.get_stats.remote(), timeout=60)
    result, states = long_request_across_syncs(job, prompt, LONG_TOKENS)

    assert result.prompt_ids == prompt  # the prompt is the original one, never the prefix so far
    assert len(result.completions) == 2
    for c in result.completions:
        assert len(c.response_ids) == LONG_TOKENS == len(c.logprobs) == len(c.token_versions)
        assert c.token_versions == sorted(c.token_versions)
        served = sorted(set(c.token_versions))
        assert len(served) >= 4, f"only {len(served)} versions served the request: {served}"  # >= 3 interruptions
        # Replaying the decode with each token's tagged version reproduces every behaviour
        # log-prob: the tokens stayed in order across every pause, nothing was re-generated,
        # and each token was produced by the weights it is tagged with.
        replay = replay_logprobs(job.model_path, states, prompt, c.response_ids, c.token_versions)
        err = (replay - torch.tensor(c.logprobs)).abs()
        assert err.max().item() < 2e-3, (err.max().item(), int(err.argmax()))
        # Tagging each token with the version before the update would not match: the test sees
        # the difference between versions.
        shifted = [served[max(served.index(v) - 1, 0)] for v in c.token_versions]
        wrong = (replay_logprobs(job.model_path, states, prompt, c.response_ids, shifted)
                 - torch.tensor(c.logprobs)).abs()
        assert wrong.max().item() > 1e-2
    assert result.min_version == min(result.completions[0].token_versions)
    assert result.max_version == max(max(c.token_versions) for c in result.completions)
    after = ray.get(engine.get_stats.remote(), timeout=60)
    assert after["pauses"] > before["pauses"]  # requests were frozen
    # The engine also cut every response where the engine core counted its tokens at each pause (what
    # tags them on a vLLM without labels, 0.26), and those cuts agreed with vLLM's labels token by
    # token (else the request fails): the target's 2 samples at 3 pauses or more, the fillers' too.
    assert after["counted_cuts"] - before["counted_cuts"] >= 3 * 2


def test_an_idle_engine_loads_without_pausing_and_new_requests_wait_for_the_load(job, tok):
    """Nothing in flight: the sync skips vLLM's pause (two round trips and a 20 ms sleep on every
    step's critical path). A request arriving while the weights load waits for them and is served
    by the new version alone."""
    import time

    import ray

    from disagg.control.types import EngineState

    engine = job.rollout.engines[0]
    v = _next_version(job)
    job.sync_weights(v, trainer_step=v)
    pauses = ray.get(engine.get_stats.remote(), timeout=60)["pauses"]
    job.trainer.announce(job.control_client(), v + 1, v + 1)
    receive = job.rollout.receive_weights_async(v + 1)  # the engine waits for the push, sent below
    deadline = time.monotonic() + 60
    while job.coordinator.state.status().engine(job.rollout.engine_ids[0]).state is not EngineState.SYNCING:
        assert time.monotonic() < deadline, "the engine never reported SYNCING"
        time.sleep(0.05)
    prompt = [tok.bos_token_id] + tok.encode("2468=", add_special_tokens=False)
    greedy = SamplingSpec(max_tokens=8, greedy=True, ignore_eos=True)
    during = engine.generate.remote([GenRequest("during-load", tuple(prompt), greedy)])
    assert not ray.wait([during], timeout=2.0)[0], "a request was served while a sync was loading"
    ray.get(job.trainer.push_weights_async(v + 1, from_snapshot=False) + receive, timeout=120)
    (res,) = ray.get(during, timeout=120)
    assert res.completions[0].token_versions == [v + 1] * 8  # every token from the loaded version
    stats = ray.get(engine.get_stats.remote(), timeout=60)
    assert stats["pauses"] == pauses  # nothing was frozen
    # The actor's start-up heap (vLLM, torch, Ray) is out of the collector's full scans.
    assert stats["gc_frozen_objects"] > 10_000, stats["gc_frozen_objects"]


def test_a_pipeline_at_staleness_one_pushes_while_the_trainer_trains(job, tok):
    import ray

    job.coordinator.state.set_max_staleness(1)
    first = _next_version(job)
    job.sync_weights(first, trainer_step=first)
    ray.get(job.trainer.rank0.set_step_delay.remote(0.3), timeout=60)
    engine = job.rollout.engines[0]
    streams = ray.get(engine.get_stats.remote(), timeout=60)["streams"]
    pipeline = _pipeline(job, tok)
    batch = job.cfg.algorithm.prompts_per_step
    try:
        # The first step ends only once the next batch is complete (the second half of the first
        # wave): the trainer gets it as that step ends, while the step's version is pushed.
        with next_step_held_until(job, lambda: pipeline.fate["taken"] >= batch
                                  and len(pipeline.sched.ready) >= batch) as released:
            records = pipeline.run(6, first_step=first)
    finally:
        ray.get(job.trainer.rank0.set_step_delay.remote(0.0), timeout=60)
    assert released, "the next batch was never complete while the first step was held"
    assert [r["policy/version_trained"] for r in records] == list(range(first, first + 6))
    assert all(r["policy/staleness_max"] <= 1 for r in records)
    # Each admission wave went to the engine as one streaming call, not one call per group (a wave
    # is whole batches whatever the order groups finish in: tests/unit/test_scheduler.py).
    calls = ray.get(engine.get_stats.remote(), timeout=60)["streams"] - streams
    assert 0 < calls < pipeline._next_gid / 2, (calls, pipeline._next_gid)
    # Groups went to the reward workers in calls of one or more (tests/unit/test_scheduler.py:
    # groups that finish together share a call), and every group got the rewards of its own texts.
    assert 0 < pipeline.fate["reward_calls"] <= pipeline._next_gid, pipeline.fate
    for g in pipeline.last_groups:
        texts = [pipeline.decode(c.response_ids) for c in g.result.completions]
        assert g.rewards == [pipeline.scorer.reward(t, g.row, Counter()) for t in texts], (g.gid, texts, g.rewards)
    timeline = ray.get(job.trainer.rank0.timeline.remote(), timeout=60)
    trains = {ver: (a, b) for what, ver, a, b in timeline if what == "train" and ver is not None and ver > first}
    pushes = {ver: (a, b) for what, ver, a, b in timeline if what == "push" and ver > first}
    assert set(pushes) == set(range(first + 1, first + 7))  # every version the run made was pushed
    assert set(trains) == set(pushes)  # ... from the snapshot its step took
    # The trainer did not wait for a push to end before its next step: some step started while the
    # previous version's push was still going on (at least the second: its batch was ready).
    overlapped = [ver for ver in pushes if ver + 1 in trains and trains[ver + 1][0] < pushes[ver][1]]
    assert overlapped, (pushes, trains)


def test_an_engine_stream_yields_each_group_as_it_completes(job, tok):
    import ray

    job.sync_weights(_next_version(job), trainer_step=0)
    prompt = tuple([tok.bos_token_id] + tok.encode("1234=", add_special_tokens=False))
    reqs = [GenRequest("long", prompt, SamplingSpec(max_tokens=LONG_TOKENS, greedy=True, ignore_eos=True)),
            GenRequest("short", prompt, SamplingSpec(max_tokens=2, n=3, ignore_eos=True))]
    stream = job.rollout.engines[0].generate_stream.options(num_returns="streaming").remote(reqs)
    first = ray.get(next(stream), timeout=120)
    assert (first.request_id, [len(c.response_ids) for c in first.completions]) == ("short", [2, 2, 2])
    second = ray.get(next(stream), timeout=120)
    assert (second.request_id, len(second.completions[0].response_ids)) == ("long", LONG_TOKENS)
    assert all(len(c.logprobs) == len(c.response_ids) for r in (first, second) for c in r.completions)
    with pytest.raises(StopIteration):
        next(stream)


def test_the_driver_takes_stream_results_by_group_and_every_owed_group_on_a_failure(ray_session):
    import asyncio

    import ray

    from disagg.errors import RolloutError
    from disagg.pipeline import _take
    from disagg.rollout.types import GenResult

    @ray.remote
    class Streamer:
        async def run(self, rids: list[str], fail_at: int | None, stop_at: int | None):
            for i, rid in enumerate(rids):
                await asyncio.sleep(0.01)
                if i == fail_at:
                    raise ValueError(f"request {rid} failed")
                if i == stop_at:
                    return
                yield GenResult(rid, 0, [1])

    actor = Streamer.remote()

    def start(fail_at=None, stop_at=None):
        stream = actor.run.options(num_returns="streaming").remote(["a", "b", "c"], fail_at, stop_at)
        return stream, {stream: {"a": 10, "b": 11, "c": 12}}

    def take_all(stream, gen):
        out = []
        while stream in gen:
            ray.wait([stream], timeout=60)
            out += [(gids, result if isinstance(result, BaseException) else result.request_id)
                    for gids, result in _take(gen, stream)]
        return out

    stream, gen = start()
    assert take_all(stream, gen) == [([10], "a"), ([11], "b"), ([12], "c")] and not gen
    stream, gen = start(fail_at=1)
    (got_a, (owed, error)) = take_all(stream, gen)
    assert got_a == ([10], "a") and owed == [11, 12] and "request b failed" in str(error)
    stream, gen = start(stop_at=2)
    (_, _, (owed, error)) = take_all(stream, gen)
    assert owed == [12] and isinstance(error, RolloutError) and "1 group(s) unanswered" in str(error)


def _pipeline(job, tok, cfg=None, **kw):
    from disagg.train import make_pipeline

    return make_pipeline(cfg or job.cfg, job, tok, **kw)


def test_max_staleness_zero_reproduces_the_synchronous_pattern(job, tok):
    job.coordinator.state.set_max_staleness(0)
    first = _next_version(job)
    job.sync_weights(first, trainer_step=first)
    records = _pipeline(job, tok).run(3, first_step=first)
    per_step = job.cfg.algorithm.prompts_per_step * job.cfg.algorithm.group_size
    assert [r["policy/version_trained"] for r in records] == [first, first + 1, first + 2]
    for r in records:
        # Every token of every trained sample came from the version being trained: on-policy.
        assert r["policy/oldest_token_version"] == r["policy/newest_token_version"] == r["policy/version_trained"]
        assert r["policy/staleness_max"] == 0 and r["samples/dropped_stale"] == 0
        assert r["samples/trained"] == per_step
        assert r["rollout/inflight_groups"] == 0 and r["rollout/ready_groups"] == 0  # nothing ran ahead
        # The trainer waited for its push: its wait spans the trainer's own send of the version.
        assert r["timing/trainer_sync_wait_s"] >= r["weight_sync/send_s"] > 0, r
        # The engine's phases of that sync: its worker's receive loop ran inside the update RPC, inside the sync.
        assert 0 < r["weight_sync/engine_worker_receive_s"] <= r["weight_sync/engine_update_s"], r
        assert r["weight_sync/engine_manifest_s"] + r["weight_sync/engine_update_s"] <= r["timing/weight_sync_s"], r


def test_staleness_is_bounded_with_a_slow_trainer_and_changed_at_run_time_over_grpc(job, tok):
    import ray


    job.coordinator.state.set_max_staleness(2)
    ray.get(job.trainer.rank0.set_step_delay.remote(0.6), timeout=60)
    client = job.control_client()
    changed_at: list[int] = []

    def on_step(step: int, rec: dict) -> None:
        if len(changed_at) == 0 and step >= first + 2:
            assert client.set_max_staleness(0) == 0  # over real gRPC, as `disagg ctl set-staleness 0`
            changed_at.append(step)

    first = _next_version(job)
    job.sync_weights(first, trainer_step=first)
    pipeline = _pipeline(job, tok, on_step=on_step)
    batch = job.cfg.algorithm.prompts_per_step
    try:
        # The first step ends only once the rest of the first wave (two more batches, generated on
        # the first version) is complete: the next steps train them one and two versions later.
        with next_step_held_until(job, lambda: pipeline.fate["taken"] >= batch
                                  and len(pipeline.sched.ready) >= 2 * batch) as released:
            records = pipeline.run(6, first_step=first)
    finally:
        ray.get(job.trainer.rank0.set_step_delay.remote(0.0), timeout=60)
    assert released, "the rest of the first wave was never complete while the first step was held"
    assert changed_at
    for r in records:
        assert r["policy/staleness_max"] <= r["policy/max_staleness_limit"], r
    before = [r for r in records if r["policy/version_trained"] <= changed_at[0]]
    after = [r for r in records if r["policy/version_trained"] > changed_at[0] + 1]
    # With a slow trainer and a limit of 2, generation ran ahead: stale samples were trained.
    assert max(r["policy/staleness_max"] for r in before) >= 1
    # After the limit dropped to 0, only on-policy samples were trained and the buffered,
    # now too stale groups were dropped and counted, not trained.
    assert after and all(r["policy/staleness_max"] == 0 for r in after)
    assert records[-1]["samples/dropped_stale"] > 0
    assert all(r["policy/max_staleness_limit"] == 0 for r in after)


def test_a_sync_interval_sends_every_other_version_and_the_last_within_the_staleness_limit(job, tok):
    """algorithm.sync_interval=2 at staleness 2: the engine takes every second version the trainer
    makes, and the run's last; the steps between have no sync (``weight_sync/skipped``), samples stay
    inside the limit, and the engine serves the trainer's final weights when the run ends."""
    import dataclasses

    import ray

    job.coordinator.state.set_max_staleness(2)
    cfg = dataclasses.replace(job.cfg, algorithm=dataclasses.replace(job.cfg.algorithm, sync_interval=2))
    first = _next_version(job)
    job.sync_weights(first, trainer_step=first)
    pipeline = _pipeline(job, tok, cfg=cfg)
    records = pipeline.run(5, first_step=first)
    assert [r["policy/version_trained"] for r in records] == list(range(first, first + 5))
    # versions first+1 .. first+5: every second one goes out (counted from first), and the last
    assert [r["weight_sync/skipped"] for r in records] == [1, 0, 1, 0, 0], records
    assert all(r["weight_sync/bytes"] == 0 for r in records if r["weight_sync/skipped"])
    assert all(r["weight_sync/bytes"] > 0 for r in records if not r["weight_sync/skipped"])
    assert all(r["policy/staleness_max"] <= 2 for r in records)
    assert pipeline.prompts_lost() == 0
    state = job.coordinator.state
    assert state.committed_version() == first + 5 == pipeline.version
    assert ray.get(job.rollout.engines[0].get_version.remote(), timeout=60)["policy_version"] == first + 5


def test_periodic_checkpoints_hold_exactly_every_nth_step_at_staleness_one(job, tok):
    """trainer.checkpoint_every=2 at staleness 1 with a slow trainer: the next batch is ready as each
    step ends, yet every checkpoint holds exactly an even step (none slips past its step while the
    next one trains), taken with the trainer idle and the engine serving the checkpoint's version."""
    import dataclasses

    import ray

    state = job.coordinator.state
    state.set_max_staleness(1)
    cfg = dataclasses.replace(job.cfg, trainer=dataclasses.replace(job.cfg.trainer, checkpoint_every=2))
    first = _next_version(job)
    job.sync_weights(first, trainer_step=first)
    taken: list[tuple[int, int, int, bool]] = []
    pipeline = None

    def checkpoint(step: int, version: int) -> str:
        taken.append((step, version, state.committed_version(), pipeline.train.running))
        return f"ckpt-{step}"

    ray.get(job.trainer.rank0.set_step_delay.remote(0.3), timeout=60)
    try:
        pipeline = _pipeline(job, tok, cfg=cfg, checkpoint=checkpoint)
        records = pipeline.run(6, first_step=first)
    finally:
        ray.get(job.trainer.rank0.set_step_delay.remote(0.0), timeout=60)
    steps = list(range(first, first + 6))  # step s trains version s (the initial weights are version first)
    assert [r["policy/version_trained"] for r in records] == steps
    # The even steps but the run's last (the driver writes that one after the run), each once.
    assert [t[0] for t in taken] == [s for s in steps[:-1] if s % 2 == 0], (taken, steps)
    for step, version, serving, training in taken:
        assert version == step + 1 and serving == version and not training, taken
    assert max(r["policy/staleness_max"] for r in records) >= 1  # the run did go ahead of the trainer


def test_a_sync_stops_the_requests_no_step_can_train_and_no_other(job, tok):
    """GenRequest.stale_drop in keep mode (requests frozen across syncs)."""
    prompt = [tok.bos_token_id] + tok.encode("2468=", add_special_tokens=False)
    a_sync_stops_what_no_step_can_train(job, prompt, LONG_TOKENS)


def _stream_with_long_groups(job, tok, limit: int, every: int, stale_groups: str = "drop"):
    """A stream pipeline (16 groups in flight) at staleness ``limit`` whose every ``every``-th group
    runs LONG_TOKENS (the others 4 tokens), from a version synced now: (the pipeline, that version,
    engine 0's stats before it runs). ``stale_groups``: ``algorithm.stale_groups``."""
    import dataclasses
    import itertools

    import ray

    job.coordinator.state.set_max_staleness(limit)
    first = _next_version(job)
    job.sync_weights(first, trainer_step=first)
    before = ray.get(job.rollout.engines[0].get_stats.remote(), timeout=60)
    turn = itertools.count()

    def lengths(row):
        n = LONG_TOKENS if next(turn) % every == 1 else 4
        return SamplingSpec(max_tokens=n, temperature=1.0, n=job.cfg.algorithm.group_size, ignore_eos=True)

    cfg = dataclasses.replace(job.cfg, rollout=dataclasses.replace(job.cfg.rollout, scheduler="stream",
                                                                   max_inflight_groups=16),
                              algorithm=dataclasses.replace(job.cfg.algorithm, stale_groups=stale_groups))
    return _pipeline(job, tok, cfg=cfg, sampling_for=lengths), first, before


def test_a_stream_stops_the_groups_no_step_can_train_and_loses_none(job, tok):
    """The pipeline's side: groups its engine stopped come back ``dropped="stale"`` and are counted
    as stale drops (in flight), every prompt is accounted for, and no trained sample is past the limit."""
    import ray

    engine = job.rollout.engines[0]
    # every fourth group runs long: too long to be trained one version on
    pipeline, first, before = _stream_with_long_groups(job, tok, limit=1, every=4)
    records = pipeline.run(8, first_step=first)
    after = ray.get(engine.get_stats.remote(), timeout=60)
    stopped = records[-1]["samples/dropped_stale_in_flight_groups"]
    assert stopped > 0, records[-1]
    # Every group the engine stopped reached the driver, but those the run's last sync stopped: the
    # run had ended, and they are among the groups it left in flight.
    engine_stopped = after["dropped_stale_in_flight"] - before["dropped_stale_in_flight"]
    assert stopped <= engine_stopped <= stopped + pipeline.abandoned_groups, (engine_stopped, pipeline.abandoned_groups)
    assert records[-1]["samples/dropped_stale"] >= stopped * job.cfg.algorithm.group_size
    assert records[-1]["rollout/prompts_lost"] == 0 and pipeline.prompts_lost() == 0
    assert all(r["policy/staleness_max"] <= 1 for r in records)
    assert all(r["samples/trained"] > 0 for r in records)


def test_a_stream_that_waits_for_its_old_groups_trains_every_long_group_within_the_limit(job, tok):
    """algorithm.stale_groups=wait, the same heavy tail as above: the steps that are a long group's last
    chance wait for it, so no sample is dropped as stale (none stopped in flight) and none trained is
    past the limit."""
    import ray

    engine = job.rollout.engines[0]
    pipeline, first, before = _stream_with_long_groups(job, tok, limit=1, every=4, stale_groups="wait")
    records = pipeline.run(8, first_step=first)
    after = ray.get(engine.get_stats.remote(), timeout=60)
    last = records[-1]
    assert last["samples/steps_held_for_old_groups"] > 0, last
    assert last["samples/dropped_stale"] == 0 and last.get("samples/dropped_stale_in_flight_groups", 0) == 0, last
    # groups the run left in flight at its end may be stopped by its last sync: no more than those
    assert after["dropped_stale_in_flight"] - before["dropped_stale_in_flight"] <= pipeline.abandoned_groups
    assert all(r["policy/staleness_max"] <= 1 for r in records)
    # long responses were trained (the short ones are 4 tokens each: any long group lifts a step's mean)
    assert sum(r["response/len_mean"] > 4.5 for r in records) >= 2, [r["response/len_mean"] for r in records]
    assert last["rollout/prompts_lost"] == 0 and pipeline.prompts_lost() == 0


def test_groups_still_generating_when_a_run_ends_are_aborted_in_the_engine(job, tok):
    """A run that ends with groups in flight (the stream admits ahead of the trainer) cancels their
    calls: the engine aborts their vLLM requests instead of generating them for no step, where a
    next run on the same engines (a bench's runs) would queue behind them."""
    import time

    import ray

    engine = job.rollout.engines[0]
    # every other group runs long: those are the ones in flight at the end
    pipeline, first, before = _stream_with_long_groups(job, tok, limit=4, every=2)
    pipeline.run(1, first_step=first)
    assert pipeline.abandoned_groups > 0  # else the run ended with nothing to cancel
    deadline = time.monotonic() + 30
    while True:
        after = ray.get(engine.get_stats.remote(), timeout=60)
        if after["unfinished_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after["unfinished_requests"] == 0, after
    # cancelled, not finished: the requests of the groups the run left were aborted
    assert after["requests_cancelled"] - before["requests_cancelled"] > 0, (before, after)
    assert pipeline.gen.inflight() == 0
