"""transport.delta=on into a real vLLM engine on a GPU (direct loads, NCCL with two GPUs, gloo
through host memory with one): after 50 delta syncs at a realistic learning rate every vLLM
parameter is the bf16 cast of the trainer's, bit for bit, and the syncs sent a share of the bytes."""

from __future__ import annotations

import pytest
import torch

from disagg.samples import TrainSample
from tests.gpu.test_vllm_engine import _as_vllm_parameters, _ids, start_job

pytestmark = pytest.mark.gpu

SYNCS = 50


@pytest.fixture(scope="module")
def job(ray_session, model_cache, tmp_path_factory):
    # A small learning rate and bf16 on the wire: most values stay the same from one step to the next.
    j = start_job(model_cache, tmp_path_factory.mktemp("gpu-delta"), [
        "trainer.lr=1e-5", "transport.delta=on", "transport.dtype=bfloat16", "transport.bucket_bytes=262144"])
    yield j
    j.shutdown()


def test_fifty_delta_syncs_leave_every_vllm_parameter_the_bf16_cast_of_the_trainers(job, tok):
    import ray

    from disagg.transport.buckets import bucket_checksum

    first = job.sync_weights(1, trainer_step=0)
    assert first.changed_fraction is None  # dense: the engine held nothing
    prompt = _ids(tok, "2468=")
    syncs = []
    for v in range(2, SYNCS + 2):
        batch = [TrainSample(prompt, [5 + (i + v) % 7, 6, 7, 8], [-1.0] * 4, 1.0 if i % 2 else -1.0, 0.0, v - 1)
                 for i in range(8)]
        job.trainer.train_step(batch)
        syncs.append(job.sync_weights(v, trainer_step=v - 1))
    assert all(s.changed_fraction is not None and s.wire_bytes < s.bytes for s in syncs), \
        [(s.changed_fraction, s.wire_bytes, s.bytes) for s in syncs]
    print(f"{SYNCS} deltas: changed {min(s.changed_fraction for s in syncs):.4f}.."
          f"{max(s.changed_fraction for s in syncs):.4f}, bytes on the wire "
          f"{sum(s.wire_bytes for s in syncs) / sum(s.bytes for s in syncs):.4f} of dense")
    engine = job.rollout.engines[0]
    want = _as_vllm_parameters(ray.get(job.trainer.rank0.full_state_dict.remote(), timeout=120))
    got = ray.get(engine.param_checksums.remote(), timeout=120)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    differ = [n for n, t in want.items() if got[n] != bucket_checksum(t.reshape(-1)).tolist()]
    assert not differ, differ[:10]
    assert ray.get(engine.get_transfer_stats.remote(), timeout=60)["load_mode"] == "direct"



def test_an_engine_refusing_a_delta_over_nccl_keeps_serving_and_gets_that_version_again_dense(job, tok):
    # As tests/integration/test_delta_sync.py on CPU, over NCCL into vLLM's worker on its GPU: the
    # worker forgets its image's version, refuses the next delta (nothing loaded), is kept, and the
    # version goes again dense on a rebuilt group; the next sync is a delta again.
    import ray

    from disagg.train import make_pipeline
    from disagg.transport.buckets import bucket_checksum

    engine = job.rollout.engines[0]
    version = ray.get(engine.get_version.remote(), timeout=60)["policy_version"]
    if version == 0:  # run alone
        job.sync_weights(1, trainer_step=0)
        version = 1
    ray.get(engine.arm_fault.remote("delta_image_lost", "flag", 1), timeout=60)
    job.coordinator.state.set_max_staleness(0)
    records = make_pipeline(job.cfg, job, tok).run(2, first_step=version)
    last = records[-1]
    assert last["transport/sync_failures"] == 1 and last["transport/sync_retries"] == 1, last
    assert last["rollout/engine_deaths"] == 0 and job.rollout.engines[0] is engine, last
    assert [r["weight_sync/delta"] for r in records] == [0, 1]
    assert records[0]["weight_sync/bytes_on_wire"] == records[0]["weight_sync/bytes"]
    want = _as_vllm_parameters(ray.get(job.trainer.rank0.full_state_dict.remote(), timeout=120))
    got = ray.get(engine.param_checksums.remote(), timeout=120)
    assert not [n for n, t in want.items() if got[n] != bucket_checksum(t.reshape(-1)).tolist()]
