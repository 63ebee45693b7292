"""Micro-batches under a token budget: every sample once, padding bounded, the gradient unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from disagg.trainer.batching import micro_batches
from disagg.trainer.grpo import ppo_clip_loss


def _heavy_tail(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [2048 + rng.randrange(32) if rng.random() < 0.1 else 128 + rng.randrange(32) for _ in range(n)]


def test_without_a_budget_micro_batches_are_runs_in_arrival_order():
    assert micro_batches([5, 1, 9, 2, 7], max_rows=2) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("max_rows,max_tokens", [(8, 32768), (64, 16384), (64, 1000), (3, 10**9)])
def test_a_budget_takes_every_sample_once_and_bounds_each_micro_batch(max_rows, max_tokens):
    lengths = _heavy_tail(128)
    batches = micro_batches(lengths, max_rows, max_tokens)
    assert sorted(i for b in batches for i in b) == list(range(128))
    for b in batches:
        assert len(b) <= max_rows
        longest = max(lengths[i] for i in b)
        assert len(b) == 1 or len(b) * longest <= max_tokens


def test_on_a_heavy_tail_a_budget_pads_far_less_than_arrival_order():
    lengths = _heavy_tail(128)

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    arrival, budget = micro_batches(lengths, 64), micro_batches(lengths, 64, 32768)
    # arrival order: both micro-batches catch a long sample; by length, long ones go together
    assert padded(budget) < padded(arrival) / 3
    assert padded(budget) < 1.5 * sum(lengths)


def test_the_gradient_does_not_depend_on_how_a_mini_batch_is_cut():
    torch.manual_seed(0)
    lengths = [3, 9, 2, 8, 4, 7]
    w = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)  # stand-in for a policy's log-probs
    mask = torch.zeros(6, 9, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    behaviour = (w.detach() + 0.1 * torch.randn(6, 9, dtype=torch.float64))
    adv = torch.randn(6, dtype=torch.float64)
    normaliser = float(mask.sum())

    def grad(batches):
        w.grad = None
        for rows in batches:
            idx = torch.tensor(rows)
            out = ppo_clip_loss(w[idx], behaviour[idx], adv[idx], mask[idx], 0.2, normaliser)
            out.loss.backward()
        return w.grad.clone()

    arrival = grad(micro_batches(lengths, 2))
    by_length = grad(micro_batches(lengths, 4, 16))
    assert micro_batches(lengths, 4, 16) != micro_batches(lengths, 2)
    torch.testing.assert_close(by_length, arrival)
