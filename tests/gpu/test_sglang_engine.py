"""A real SGLang engine (``rollout.engine=sglang``) on a GPU, fed by a trainer on a GPU: the engine
actor starts it on dummy weights and holds every request until the first sync; the trainer's weights
come over disagg's transport into SGLang's scheduler (disagg's plugin methods, ``rollout/sglang/hook.py``)
and land in its parameters bit for bit; greedy tokens and log-probs then agree with the trainer's HF
model; and requests in flight across a sync are resubmitted on the new weights with each token's
version known.

SGLang has no CPU build: these run on the GPU machines with its site on the path
(``ENGINE=sglang bash benchmarks/gpu_e2e.sh tests tests/gpu/test_sglang_engine.py``). The layout is
``test_vllm_engine``'s (NCCL with two GPUs, gloo through host memory on one). The tests run in file
order (the first must see the engine before its first sync).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from disagg.rollout.types import GenRequest, SamplingSpec
from disagg.samples import TrainSample
from tests.gpu.test_vllm_engine import (BF16_LOGPROB_TOL, PROMPTS, _as_vllm_parameters, _ids, _layout,
                                        first_sync_opens_the_gate, start_job)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="SGLang cannot be imported here (no CPU build is published; on a GPU machine run "
                              "ENGINE=sglang benchmarks/gpu_e2e.sh, which puts its site on the path)"),
]

IN_FLIGHT_TOKENS = 400  # long enough that a sync comes while the request generates


@pytest.fixture(scope="module")
def job(ray_session, model_cache, tmp_path_factory):
    j = start_job(model_cache, tmp_path_factory.mktemp("gpu-sglang-run"), [
        "rollout.engine=sglang", "trainer.lr=3e-2",
        "rollout.max_model_len=1024", "model.tiny.max_position_embeddings=1024", "rollout.max_num_seqs=64",
        # smaller than an MLP weight: syncs carry tensors split over buckets
        "transport.bucket_bytes=49152", "transport.first_bucket_bytes=6144"])
    yield j
    j.shutdown()


def _greedy(job, tok) -> list:
    import ray

    spec = SamplingSpec(max_tokens=8, greedy=True)
    reqs = [GenRequest(f"g{i}-{job.coordinator.state.latest_version()}", tuple(_ids(tok, p)), spec)
            for i, p in enumerate(PROMPTS)]
    return ray.get(job.rollout.engines[0].generate.remote(reqs), timeout=300)


def test_the_engine_waits_for_the_first_sync(job, tok):
    info = job.rollout.start_info[0]
    print(f"engine: SGLang {info['sglang_version']}, in-flight requests at a sync: {info['in_flight_at_sync']}, "
          f"layout {_layout()}, transport {job.backend}")
    assert info["in_flight_at_sync"] == "resubmit" and info["token_version_sources"] == []
    first_sync_opens_the_gate(job, tok, wait_s=5.0, timeout_s=300)


def test_a_sync_leaves_every_sglang_parameter_the_bf16_cast_of_the_trainers_bit_for_bit(job, tok):
    import ray

    from disagg.transport.buckets import bucket_checksum

    engine = job.rollout.engines[0]
    batch = [TrainSample(_ids(tok, "1357="), [5 + i, 6, 7, 8], [-1.0] * 4, 1.0 if i % 2 else -1.0, 0.0, 1)
             for i in range(8)]
    plans = []
    for _ in range(2):  # the second sync of the layout replays the copy plan the first learned
        v = job.coordinator.state.latest_version() + 1
        job.trainer.train_step(batch)
        job.sync_weights(v, trainer_step=v)
        stats = ray.get(engine.get_transfer_stats.remote(), timeout=60)
        plans.append(stats["copy_plan"])
    assert stats["load_mode"] == "direct" and plans[-1].startswith("replayed"), (stats, plans)
    want = _as_vllm_parameters(ray.get(job.trainer.rank0.full_state_dict.remote(), timeout=120))
    got = ray.get(engine.param_checksums.remote(), timeout=120)
    missing = sorted(set(want) - set(got))
    assert not missing, f"trainer tensors with no SGLang parameter of that name: {missing}"
    differ = [n for n, t in want.items() if got[n] != bucket_checksum(t.reshape(-1)).tolist()]
    print(f"{len(want)} SGLang parameters after {plans}: {len(differ)} differ from the trainer's bf16 cast")
    assert not differ, differ[:10]


def test_greedy_tokens_and_log_probs_agree_with_the_trainers_model(job, tok):
    import ray

    results = _greedy(job, tok)
    served = [(r.completions[0].response_ids, r.completions[0].logprobs) for r in results]
    prompts = [_ids(tok, p) for p in PROMPTS]
    greedy = ray.get(job.trainer.rank0.greedy.remote(prompts, 8, tok.eos_token_id), timeout=120)
    version = job.coordinator.state.latest_version()
    samples = [TrainSample(p, ids, lps, 0.0, 0.0, version) for p, (ids, lps) in zip(prompts, served)]
    scored = ray.get(job.trainer.rank0.logprobs.remote(samples), timeout=120)
    errors = [abs(a - float(b)) for (_, lps), s in zip(served, scored) for a, b in zip(lps, s)]
    print(f"v{version}: max |engine - trainer| log-prob {max(errors):.4f} over {len(errors)} tokens (bf16 engine)")
    assert [ids for ids, _ in served] == greedy
    assert max(errors) < BF16_LOGPROB_TOL
    assert all(r.min_version == r.max_version == version for r in results)


def test_a_request_in_flight_across_a_sync_goes_on_with_each_tokens_version(job, tok):
    import ray

    engine = job.rollout.engines[0]
    before = ray.get(engine.get_stats.remote(), timeout=60)
    prompt = _ids(tok, "4321=")
    spec = SamplingSpec(max_tokens=IN_FLIGHT_TOKENS, ignore_eos=True)
    target = engine.generate.remote([GenRequest("long", tuple(prompt), spec)])
    batch = [TrainSample(prompt, [5 + i, 6, 7, 8], [-1.0] * 4, 1.0 if i % 2 else -1.0, 0.0, 1) for i in range(8)]
    first = job.coordinator.state.latest_version()
    while not ray.wait([target], timeout=0.5)[0] and job.coordinator.state.latest_version() < first + 3:
        job.trainer.train_step(batch)
        v = job.coordinator.state.latest_version() + 1
        job.sync_weights(v, trainer_step=v)
    (res,) = ray.get(target, timeout=300)
    after = ray.get(engine.get_stats.remote(), timeout=60)
    (c,) = res.completions
    print(f"versions {sorted(set(c.token_versions))}, pieces {c.pieces}, resubmits "
          f"{after['resubmits'] - before['resubmits']}")
    assert len(c.response_ids) == len(c.logprobs) == len(c.token_versions) == IN_FLIGHT_TOKENS
    assert c.token_versions == sorted(c.token_versions) and len(set(c.token_versions)) >= 2
    assert after["resubmits"] > before["resubmits"] and c.pieces
    # each continuation took its KV over from SGLang's radix cache (the request's salt kept its chain)
    assert any(kept > 0 for _, kept in c.pieces), c.pieces
    assert (res.min_version, res.max_version) == (min(c.token_versions), max(c.token_versions))
