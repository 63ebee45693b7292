"""Decoupled PPO in the trainer's step: the policy before the update, without a pass of its own where
the step's first forward already is that policy (one mini-batch, the default), and with one for the
mini-batches after the first optimizer step. Real ``TrainerWorker`` on CPU (no Ray), tiny model."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from disagg.config import AlgorithmConfig, TrainerConfig, TransportConfig
from disagg.samples import TrainSample


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from disagg.config import TinyModelConfig
    from disagg.model.tiny import build_model, build_tokenizer, save_checkpoint

    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(build_model(TinyModelConfig(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=64),
                                seed=0), build_tokenizer(), path)
    return path


def _worker(model_dir, mode: str):
    from disagg.trainer.worker import TrainerWorker

    w = TrainerWorker(0, 1, str(model_dir), TrainerConfig(micro_batch_size=4, lr=1e-2),
                      replace(AlgorithmConfig(), off_policy=mode), TransportConfig(dtype="bfloat16"), 1.0, "cpu")
    w.setup()
    return w


def _samples(n: int = 8) -> list[TrainSample]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        r = rng.randint(2, 6)
        out.append(TrainSample(prompt_ids=[1] + [rng.randrange(4, 14) for _ in range(4)],
                               response_ids=[rng.randrange(4, 14) for _ in range(r)],
                               behaviour_logprobs=[-2.5 + rng.uniform(-0.3, 0.3) for _ in range(r)],
                               advantage=rng.uniform(-1, 1), reward=0.0, policy_version=0))
    return out


def _params(w) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in w.model.named_parameters()}


def _explicit(w, samples, num_mb):
    """The step as written out: every sample's proximal log-probs from a pass before any update."""
    prox = w._proximal_logprobs(samples)
    totals = dict.fromkeys(("clip", "ratio", "kl_b", "kl_ref", "tokens", "loss", "mm_sum", "mm_max", "mm_over",
                            "mm_tokens"), 0.0)
    for j in range(num_mb):
        idx = list(range(j, len(samples), num_mb))
        tokens = sum(len(samples[i].response_ids) for i in idx)
        w._accumulate([samples[i] for i in idx], [prox[i] for i in idx], tokens, "decoupled", totals,
                      before_update=j == 0)
        w._optimizer_step()
    return totals


@pytest.mark.parametrize("num_mb", [1, 2])
def test_decoupled_steps_train_from_the_policy_before_the_update_with_one_pass_less(model_dir, num_mb, monkeypatch):
    samples = _samples()
    tokens = [sum(len(s.response_ids) for s in samples[j::num_mb]) for j in range(num_mb)]
    a, b = _worker(model_dir, "decoupled"), _worker(model_dir, "decoupled")
    calls = []
    real = a._proximal_logprobs
    monkeypatch.setattr(a, "_proximal_logprobs", lambda s: calls.append(len(s)) or real(s))
    out = a.train_step(samples, tokens)
    want = _explicit(b, samples, num_mb)
    # the first mini-batch needs no pass of its own; the later ones' samples get one, before any update
    assert calls == ([] if num_mb == 1 else [len(samples) - len(samples[0::num_mb])])
    pa, pb = _params(a), _params(b)
    moved = max((pb[n] - p).abs().max().item() for n, p in _params(_worker(model_dir, "ppo")).items())
    assert moved > 1e-3  # the step moved the weights, so their agreement below says something
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], rtol=1e-5, atol=1e-6)
    assert out["mismatch_tokens"] == want["mm_tokens"] == sum(len(s.response_ids) for s in samples[0::num_mb]) \
        + (0 if num_mb == 1 else sum(len(s.response_ids) for s in samples[1::num_mb]))
    assert out["mismatch_abs_sum"] == pytest.approx(want["mm_sum"], rel=1e-5)


@pytest.mark.parametrize("mode", ["ppo", "tis"])
def test_other_modes_take_no_proximal_pass_over_several_mini_batches(model_dir, mode, monkeypatch):
    samples = _samples()
    w = _worker(model_dir, mode)
    monkeypatch.setattr(w, "_proximal_logprobs", lambda s: pytest.fail("only decoupled needs the proximal pass"))
    before = _params(w)
    out = w.train_step(samples, [sum(len(s.response_ids) for s in samples[j::2]) for j in range(2)])
    assert max((p - before[n]).abs().max().item() for n, p in _params(w).items()) > 1e-3
    # the mismatch is taken before the first optimizer step only: mini-batch 0's tokens
    assert out["mismatch_tokens"] == sum(len(s.response_ids) for s in samples[0::2])
