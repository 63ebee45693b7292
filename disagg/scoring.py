"""Turn engine results into training samples: rewards, group advantages, drops.

A prompt the engine could not serve, or a sample whose reward function raised,
is dropped or scored 0 and counted - never the run. A reward traceback is
logged once per exception type so a broken reward is visible without flooding
the log.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from disagg.config import AlgorithmConfig
from disagg.rollout.types import GenResult
from disagg.samples import TrainSample
from disagg.tasks.base import RewardFn, safe_reward
from disagg.trainer.grpo import group_advantages

log = logging.getLogger("disagg.scoring")


@dataclass
class ScoredBatch:
    samples: list[TrainSample]
    rewards: list[float]
    response_lens: list[int]
    counts: Counter = field(default_factory=Counter)


class Scorer:
    def __init__(self, reward_fn: RewardFn, decode: Callable[[list[int]], str], algo: AlgorithmConfig,
                 latency_s: float = 0.0):
        self.reward_fn = reward_fn
        self.decode = decode
        self.algo = algo
        self.latency_s = latency_s  # reward.latency_s: extra seconds per sample (benchmarks)
        self._logged: set[str] = set()

    def reward(self, text: str, row: dict[str, Any], counts: Counter) -> float:
        """The reward of one response; an exception or NaN scores 0 and is counted in ``counts``."""
        return safe_reward(self.reward_fn, text, row, counts, self._logged, self.latency_s)

    def group_samples(self, res: GenResult, rewards: list[float], counts: Counter) -> list[TrainSample]:
        """The training samples of one scored group (advantages normalised within it).

        Empty responses are dropped and counted. Each sample's ``policy_version`` is the
        oldest version among its tokens (what staleness is measured from).
        """
        adv = group_advantages(torch.tensor([rewards]), self.algo.adv_eps, self.algo.scale_by_std)[0].tolist()
        out = []
        for c, r, a in zip(res.completions, rewards, adv):
            if not c.response_ids:
                counts["dropped_empty_response"] += 1
                continue
            version = min(c.token_versions) if c.token_versions else res.min_version
            out.append(TrainSample(list(res.prompt_ids), list(c.response_ids), list(c.logprobs), a, r, version,
                                   list(c.loss_mask) if c.loss_mask is not None else None))
        return out

    def check_group(self, res: GenResult, counts: Counter) -> bool:
        """Whether ``res`` is a complete group to score; counts why not."""
        if res.dropped is not None:
            counts[f"dropped_{res.dropped}"] += 1
            return False
        if len(res.completions) != self.algo.group_size:
            counts["dropped_incomplete_group"] += 1
            log.warning("request %s returned %d of %d samples; group dropped", res.request_id,
                        len(res.completions), self.algo.group_size)
            return False
        return True

    def score(self, results: list[GenResult], rows: list[dict[str, Any]]) -> ScoredBatch:
        counts: Counter = Counter()
        samples, rewards, lens = [], [], []
        for res, row in zip(results, rows):
            if res.dropped is not None:
                counts[f"dropped_{res.dropped}"] += 1
                continue
            if len(res.completions) != self.algo.group_size:
                counts["dropped_incomplete_group"] += 1
                log.warning("request %s returned %d of %d samples; group dropped", res.request_id,
                            len(res.completions), self.algo.group_size)
                continue
            group_r = [self.reward(self.decode(c.response_ids), row, counts) for c in res.completions]
            adv = group_advantages(torch.tensor([group_r]), self.algo.adv_eps, self.algo.scale_by_std)[0].tolist()
            for c, r, a in zip(res.completions, group_r, adv):
                rewards.append(r)
                lens.append(len(c.response_ids))
                if not c.response_ids:
                    counts["dropped_empty_response"] += 1
                    continue
                samples.append(TrainSample(list(res.prompt_ids), list(c.response_ids), list(c.logprobs), a, r,
                                           res.min_version))
        return ScoredBatch(samples, rewards, lens, counts)
