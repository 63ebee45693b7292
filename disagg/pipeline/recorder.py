"""The step recorder: where a step's timings and metrics are made (pure bookkeeping, no Ray).

A step's record is made when its weight sync lands, so a step's metrics cover: the trainer waiting
for a batch (``timing/rollout_s``), training, the sync, and the trainer blocked on pushing its
weights (``timing/trainer_sync_wait_s``); plus what was generated meanwhile and the run's totals.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from disagg.pipeline.scheduler import Group


@dataclass
class StepRecord:
    """What one train step consumed, kept until its weight sync completed."""

    step: int
    version_trained: int
    groups: list[Group]
    t_batch: float  # when the batch was formed
    limit: int = 0  # the staleness limit the batch was formed under
    t_train_done: float = 0.0
    train: dict[str, float] = field(default_factory=dict)


class StepRecorder:
    """Accumulates the current step's timings and generation, and makes each step's metrics.

    The trainer's time between steps is split in two: blocked on its own weight push (from a train
    step's end until the trainer is free: ``trainer_free``) and idle waiting for a batch (from then
    until a batch is taken: ``batch_taken``).
    """

    def __init__(self, agent: bool = False, now: float | None = None) -> None:
        self.agent = agent
        self.records: list[dict] = []  # every step's metrics, in order
        self.trained_tokens = 0
        self.trained_samples = 0
        self.beyond_staleness = 0  # trained samples older than the limit allowed: must stay 0
        self.trained_by_engine: Counter = Counter()  # trained groups per engine id
        self.first_trained_version: dict[int, int] = {}  # engine id -> oldest token version of its first trained group
        self.begin(time.perf_counter() if now is None else now)

    def begin(self, now: float) -> None:
        """The run starts (the trainer is free, waiting for its first batch)."""
        self.t_last = now  # the previous step's record
        self.t_idle_from: float | None = now  # trainer free (step done, weights pushed) since
        self.t_trained: float | None = None  # the last train step's end, until the trainer is free again
        self._new_step()

    def _new_step(self) -> None:
        self.idle_s = 0.0
        self.sync_wait_s = 0.0
        self.gen_tokens = 0
        self.latencies: list[float] = []  # generation time of the groups finished since the last step
        self.engine_tokens: Counter = Counter()

    # ---- events ----------------------------------------------------------------------------
    def generated(self, engine: int, tokens: int, seconds: float) -> None:
        """A group finished generating (``engine`` -1: an agent runner's group)."""
        self.gen_tokens += tokens
        if engine >= 0:
            self.engine_tokens[engine] += tokens
        self.latencies.append(seconds)

    def trainer_free(self, now: float) -> None:
        """The trainer may take a batch: its step is done and its weights pushed (or sent from a copy)."""
        if self.t_idle_from is None:
            self.t_idle_from = now
            if self.t_trained is not None:
                self.sync_wait_s += now - self.t_trained
                self.t_trained = None

    def batch_taken(self, t_batch: float) -> None:
        self.idle_s += t_batch - self.t_idle_from
        self.t_idle_from = None

    def trained(self, now: float) -> None:
        self.t_trained = now

    def engine_rates(self, load: dict[int, int], now: float) -> dict[int, tuple[int, float]]:
        """Engine id -> (groups in flight, tokens/s this step), for the coordinator's run stats."""
        step_s = max(now - self.t_last, 1e-9)
        return {i: (load[i], self.engine_tokens.get(i, 0) / step_s) for i in load}

    # ---- a step's metrics --------------------------------------------------------------------
    def step_done(self, record: StepRecord, sync, now: float, run: dict[str, Any]) -> dict[str, Any]:
        """``record``'s metrics, its weights synced by ``sync`` (``weightsync.SyncStats``) at ``now``; ``run``
        holds the run's totals (counters: prompts drawn and lost, engines, drops, ...)."""
        step_s = now - self.t_last
        samples = [s for g in record.groups for s in g.samples]
        rewards = [r for g in record.groups for r in g.rewards]
        stale = [record.version_trained - s.policy_version for s in samples]
        self.beyond_staleness += sum(1 for x in stale if x > record.limit)
        tokens = sum(s.num_trained_tokens for s in samples)
        for g in record.groups:
            self.trained_by_engine[g.engine] += 1
            self.first_trained_version.setdefault(g.engine, g.min_version)
        self.trained_tokens += tokens
        self.trained_samples += len(samples)
        rec = {
            "policy_version": record.version_trained + 1,
            "policy/version_trained": record.version_trained,
            "policy/staleness_max": max(stale, default=0),
            "policy/staleness_mean": sum(stale) / max(len(stale), 1),
            "policy/max_staleness_limit": record.limit,
            "policy/oldest_token_version": min((s.policy_version for s in samples), default=0),
            "policy/newest_token_version": max((g.max_version for g in record.groups), default=0),
            "policy/versions_per_sample_max": max((g.max_version - g.min_version for g in record.groups), default=0),
            "reward/mean": sum(rewards) / max(len(rewards), 1),
            "reward/max": max(rewards, default=0.0),
            "response/len_mean": tokens / max(len(samples), 1),
            "samples/trained": len(samples),
            **run,
            "samples/trained_beyond_staleness": self.beyond_staleness,
            "rollout/tokens_per_s": self.gen_tokens / step_s if step_s > 0 else 0.0,
            "throughput/trained_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "throughput/samples_per_s": len(samples) / step_s if step_s > 0 else 0.0,
            "timing/rollout_s": self.idle_s,  # the trainer waiting for a batch (generation not hidden)
            "timing/train_s": record.t_train_done - record.t_batch,
            "timing/weight_sync_s": sync.seconds,
            "weight_sync/bytes": sync.bytes,
            "weight_sync/bytes_on_wire": sync.bytes if sync.wire_bytes is None else sync.wire_bytes,
            "weight_sync/delta": int(sync.changed_fraction is not None),  # 0: dense (the first, after a join, a retry)
            **({} if sync.changed_fraction is None else {"weight_sync/changed_fraction": sync.changed_fraction}),
            "weight_sync/gb_per_s": sync.gb_per_s,
            "weight_sync/send_s": sync.send_s,
            "weight_sync/armed": int(sync.armed),
            "weight_sync/skipped": int(sync.skipped),
            **{f"weight_sync/engine_{k}": v for k, v in sync.engine_phases.items()},
            "timing/step_s": step_s,
            **{f"train/{k}": v for k, v in record.train.items()},
        }
        comps = [c for g in record.groups if g.result is not None for c in g.result.completions]
        if self.agent and comps:
            n = len(comps)
            info: Counter = Counter()
            for c in comps:
                info.update(c.info)
            rec.update({"agent/turns_mean": info["turns"] / n, "agent/tool_calls_mean": info["tool_calls"] / n,
                        "agent/tool_errors": info["tool_errors"],
                        "agent/malformed_tool_calls": info["malformed_tool_calls"],
                        **{f"agent/{k}_frac": v / n for k, v in info.items() if k.startswith("finish_")}})
        rec["timing/trainer_sync_wait_s"] = self.sync_wait_s
        rec["rollout/group_seconds_max"] = max(self.latencies, default=0.0)
        rec["rollout/group_seconds_mean"] = sum(self.latencies) / max(len(self.latencies), 1)
        self.records.append(rec)
        self.t_last = now
        self._new_step()
        return rec

    @staticmethod
    def run_totals(*, scored: Counter, sched, gen, fleet, sync, skipped_rows: int, prompts_lost: int) -> dict[str, Any]:
        """The run's counters for a step's metrics, from the counts each owner keeps of its own events:
        the scorer's (``scored``) and the scheduler's drops, ``Generation``'s, the fleet's, the syncs'."""
        counts = scored + sched.counts
        return {
            "samples/dropped_stale": counts["dropped_stale"],
            "samples/dropped_prompt_too_long": counts["dropped_prompt_too_long"],
            "samples/reward_errors": counts["reward_errors"],
            **{f"samples/{k}": v for k, v in counts.items() if k not in ("dropped_stale", "reward_errors")},
            "data/skipped_rows": skipped_rows,
            "rollout/prompts_drawn": gen.next_gid,
            "rollout/prompts_lost": prompts_lost,
            "rollout/num_engines": len(fleet.serving),
            **{f"rollout/{k}": fleet.counts[k]
               for k in ("engines_joined", "engines_left", "engine_deaths", "engines_replaced")},
            "rollout/groups_requeued": gen.counts["groups_requeued"],
            "rollout/dummy_served": gen.dummy_served,
            "transport/sync_failures": sync.counts["sync_failures"],
            "transport/sync_retries": sync.counts["sync_retries"],
            "rollout/inflight_groups": len(sched.inflight),
            "rollout/ready_groups": len(sched.ready),
        }

    @staticmethod
    def live_stats(sched, gen, rewards, training: list[StepRecord]) -> dict[str, int]:
        """The run's live figures (``disagg ctl status``): groups in the buffer, in train steps not yet
        synced (``training``), generating or scoring."""
        return {"buffer_groups": len(sched.ready), "training_groups": sum(len(r.groups) for r in training),
                "inflight_groups": gen.inflight() + rewards.inflight()}
