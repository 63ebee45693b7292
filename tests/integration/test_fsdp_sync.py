"""Two FSDP2 trainer workers (gloo) feeding one vLLM engine, in both source modes
(rank 0 sends gathered full tensors / every rank sends its shards over its own
group), the engine with one worker or tensor-parallel over two (each TP worker a
rank of every source group, receiving full tensors that vLLM's loaders slice; the
second sync a delta there): vLLM's log-probs agree with the sharded trainer's before
and after a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.rollout.types import GenRequest, SamplingSpec
from disagg.samples import TrainSample
from tests.conftest import small_config


# The tensor-parallel engines receive with transport.delta=on: every TP worker keeps its own image
# of each source group's buckets and applies the second sync onto it.
@pytest.fixture(scope="module", params=[("gather", 1, "off"), ("shards", 1, "off"), ("gather", 2, "on"),
                                        ("shards", 2, "on")],
                ids=["gather", "shards", "gather-tp2-delta", "shards-tp2-delta"])
def job(request, ray_session, model_cache, tmp_path_factory):
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    source, tp, delta = request.param
    cfg = small_config(model_cache, trainer={"num_workers": 2, "lr": 5e-2, "grad_clip": 0.0},
                       rollout={"tensor_parallel_size": tp},
                       transport={"source": source, "bucket_bytes": 256 * 1024, "delta": delta})
    j = Job.start(cfg, tmp_path_factory.mktemp("fsdp-run"), prepare_model(cfg))
    yield j
    j.shutdown()


def _samples(job, tok, tag):
    import ray

    spec = SamplingSpec(max_tokens=6, temperature=1.0, n=4, seed=7)
    prompts = ["123=", "9081=", "55=", "4242="]
    reqs = [GenRequest(f"{tag}-{i}", tuple([tok.bos_token_id] + tok.encode(p, add_special_tokens=False)), spec)
            for i, p in enumerate(prompts)]
    out = ray.get(job.rollout.engines[0].generate.remote(reqs), timeout=120)
    return [TrainSample(list(r.prompt_ids), c.response_ids, c.logprobs, 1.0 if k % 2 else -1.0, 0.0, r.min_version)
            for r in out for k, c in enumerate(r.completions)]


def _trainer_logprobs(job, samples):
    import ray

    # A forward under FSDP is a collective: every rank runs it, all return the same.
    outs = ray.get([w.logprobs.remote(samples) for w in job.trainer.workers], timeout=120)
    for a, b in zip(outs[0], outs[1]):
        assert a == pytest.approx(b, abs=1e-6)
    return outs[0]


def test_sharded_trainer_syncs_full_weights_to_vllm(job):
    import ray
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(job.model_path)
    job.sync_weights(1, trainer_step=0)
    s1 = _samples(job, tok, "a")
    for a, b in zip([s.behaviour_logprobs for s in s1], _trainer_logprobs(job, s1)):
        assert a == pytest.approx(b, abs=2e-4)

    job.trainer.train_step(s1)
    sync = job.sync_weights(2, trainer_step=1)
    full = ray.get(job.trainer.rank0.manifest.remote(2))["total_bytes"]
    assert sync.bytes == full  # one copy of the model on the wire, from one rank or split over both
    # a delta onto version 1 from each sending rank (at this learning rate nearly every value changed)
    assert (sync.changed_fraction is not None) == (job.cfg.transport.delta == "on"), sync
    s2 = _samples(job, tok, "b")
    assert all(s.policy_version == 2 for s in s2)
    for a, b in zip([s.behaviour_logprobs for s in s2], _trainer_logprobs(job, s2)):
        assert a == pytest.approx(b, abs=2e-4)
    # The step moved the policy: version-1 samples now score differently.
    moved = [abs(x - y) for a, b in zip([s.behaviour_logprobs for s in s1], _trainer_logprobs(job, s1))
             for x, y in zip(a, b)]
    assert max(moved) > 1e-3


def test_checkpoint_of_a_sharded_trainer_holds_full_tensors(job, tmp_path):
    import ray
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    if job.cfg.rollout.tensor_parallel_size > 1:
        pytest.skip("the trainer's checkpoint does not depend on the engine: checked with one engine worker")
    tok = AutoTokenizer.from_pretrained(job.model_path)
    job.sync_weights(job.coordinator.state.latest_version() + 1, trainer_step=0)
    job.trainer.train_step(_samples(job, tok, "ck"))  # optimizer state exists
    path = job.save_checkpoint(7, 8, {"note": "fsdp"})
    full = ray.get([w.full_state_dict.remote() for w in job.trainer.workers], timeout=120)[0]
    saved = load_file(f"{path}/model.safetensors")
    for name, t in full.items():
        if name in saved:  # tied lm_head is stored once
            assert torch.equal(saved[name], t), name
    assert "model.embed_tokens.weight" in saved
    opt = torch.load(f"{path}/optimizer.pt", weights_only=False)
    assert opt["world_size"] == 2
    # Full (unsharded) moments, keyed by parameter name: loadable by any number of workers.
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    state = opt["optimizer"]["state"]
    assert state and all(tuple(v["exp_avg"].shape) == shapes[k] for k, v in state.items())
    assert sorted(p.name for p in Path(path).glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
