"""``Pipeline``: the asynchronous loop, and the one handler for each kind of event.

One iteration: the operator's commands and the engines' health -> admit and dispatch new groups ->
when the trainer is free, a checkpoint or the next batch -> when a step is trained, its sync ->
wait for the next event -> hand each to its handler. The owners hold the state (docs/design.md,
"The loop"): ``GroupScheduler`` the groups, ``Generation`` the calls to the engines, ``EngineFleet``
the engines, ``RewardDispatch`` the scoring, ``SyncController`` the syncs, ``StepRecorder`` the
metrics. The loop itself keeps only the run's position: the trainer's version and step, the
version every engine serves, the step to stop after.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator

from disagg.cluster import freeze_heap
from disagg.weightsync import SyncStats
from disagg.pipeline.fleet import AgentRunners, EngineFleet, brief
from disagg.pipeline.generation import Generation
from disagg.pipeline.recorder import StepRecord, StepRecorder
from disagg.pipeline.rewards import RewardDispatch
from disagg.pipeline.scheduler import Group, GroupScheduler
from disagg.pipeline.sync_control import SyncController
from disagg.pipeline.train_step import TrainStep
from disagg.rollout.types import SamplingSpec
from disagg.samples import TrainSample

log = logging.getLogger("disagg.pipeline")


class Pipeline:
    """Drives generation, reward workers, train steps and syncs of one ``Job`` with a ``GroupScheduler``.

    ``sampling_for(row)`` may override the sampling of a prompt (benchmarks control
    response lengths with it); ``on_step(step, record)`` is called after each step's
    metrics are logged (tests change the staleness limit from it over gRPC);
    ``reward_workers`` are reward workers started by the caller (``start_reward_workers``),
    which several runs share (benchmarks), else the pipeline starts and ends its own.

    Operator commands arrive through the coordinator's state (the gRPC Ops service):
    while the rollout is paused no new group starts; a stop request ends the run after
    the step in progress (``stopped`` is then set); a checkpoint request holds back new
    train steps until the trainer is idle and every engine serves its weights, then calls
    ``checkpoint(step, version) -> path``; with ``trainer.checkpoint_every=N`` the loop asks for one
    itself as each N-th step (but the last) is trained, so it holds exactly that step.
    """

    def __init__(self, cfg, job, source: Iterator, encode: Callable[[str], tuple[int, ...]],
                 decode: Callable[[list[int]], str], scorer, metrics=None, progress=None,
                 sampling_for: Callable[[dict], SamplingSpec] | None = None,
                 on_step: Callable[[int, dict], None] | None = None, overlap_rewards: bool = True,
                 agent: bool = False, checkpoint: Callable[[int, int], str] | None = None,
                 reward_workers: list | None = None) -> None:
        self.cfg, self.job, self.data = cfg, job, source
        self.decode, self.scorer, self.agent = decode, scorer, agent
        self.metrics, self.progress, self.on_step, self.checkpoint = metrics, progress, on_step, checkpoint
        algo, roll = cfg.algorithm, cfg.rollout
        state = job.coordinator.state
        self.groups: Counter = Counter()  # the loop's own events: groups taken, trained, dropped as invalid
        self.scored: Counter = Counter()  # the scorer's counts (invalid groups, reward errors, ...)
        self.sched = GroupScheduler(algo.prompts_per_step, roll.max_inflight_groups, roll.scheduler, algo.stale_groups)
        self.runners = AgentRunners(cfg)
        sampling = SamplingSpec(max_tokens=roll.max_tokens, temperature=roll.temperature, top_p=roll.top_p,
                                n=algo.group_size)
        self.gen = Generation(job, self.sched, iter(source), encode, sampling, sampling_for,
                              self.runners if agent else None)
        self.fleet = EngineFleet(cfg, job, state, self.runners, agent, requeue=self.gen.requeue,
                                 streams_of=self.gen.streams_of, generating=self.sched.generating_on)
        self.rewards = RewardDispatch(cfg, scorer, overlap_rewards, reward_workers)
        self.sync = SyncController(cfg, job, state, self.fleet)
        self.recorder = StepRecorder(agent)
        self.train = TrainStep(job)
        self.last_batch: list[TrainSample] = []  # the samples of the latest train step (inspection)
        self.last_groups: list[Group] = []  # ... and their groups
        self.stopped: str | None = None  # the stop request's reason, when the run ended on one
        self.abandoned_groups = 0  # groups still generating when a stop ended the run
        self.last_done: tuple[int, int] = (0, 0)  # (step, policy version after it) of the last finished step
        self._stale_groups_before = 0
        self._paused_seen = False  # the operator's pause as this loop last acted on it
        # The run's position (set by run): the trainer's version and last step, what every engine
        # serves, the step to stop after.
        self.version = self.engine_version = self.step = self.last_step = 0

    # ---- views for callers and tests --------------------------------------------------------
    records = property(lambda self: self.recorder.records)
    trained_tokens = property(lambda self: self.recorder.trained_tokens)
    trained_samples = property(lambda self: self.recorder.trained_samples)
    trained_by_engine = property(lambda self: self.recorder.trained_by_engine)
    first_trained_version = property(lambda self: self.recorder.first_trained_version)
    join_version = property(lambda self: self.fleet.join_version)
    serving = property(lambda self: self.fleet.serving)
    _next_gid = property(lambda self: self.gen.next_gid)

    @property
    def fate(self) -> Counter:
        """Every owner's counts in one (a copy, to read): the loop's groups, generation, the fleet,
        the rewards and the syncs; each owner counts its own events."""
        return self.groups + self.gen.counts + self.fleet.counts + self.rewards.counts + self.sync.counts

    def agent_stats(self) -> list[dict]:
        """Each agent runner's counters (requests per engine, tool errors, ...)."""
        return self.runners.stats()

    def prompts_lost(self) -> int:
        """Prompt groups drawn from the data that were neither handed to the trainer, dropped (counted),
        nor are still generating, scoring or waiting in the buffer. Always 0 unless a group went missing."""
        # Stale drops counted by this pipeline (a resumed run starts with the checkpoint's counts).
        dropped = self.groups["dropped_invalid"] + self.sched.counts["dropped_stale_groups"] - self._stale_groups_before
        return self.gen.next_gid - self.groups["taken"] - dropped - len(self.sched.inflight) - len(self.sched.ready)

    def close(self) -> None:
        self.rewards.close()
        self.runners.close()

    # ---- the loop --------------------------------------------------------------------------
    def run(self, total_steps: int, first_step: int = 1) -> list[dict]:
        """Train ``total_steps`` steps (the initial weights must already be synced as version ``first_step``)."""
        state = self.job.coordinator.state
        self._begin(total_steps, first_step)
        try:
            while self.step < self.last_step or self.train.running or not self.sync.idle:
                limit = state.max_staleness()
                paused = self._operator(state)  # stop, scale, health, pause
                if not paused and self.fleet.serving:
                    self._admit(limit)
                self._train_or_checkpoint(state, limit)
                self._live_stats(state)  # this iteration's wave and batch in one update (a batch trains at once)
                self.sync.start_queued(self.version)  # a finished step's weights go out (or a failed sync's again)
                ready = self._wait(paused, limit)
                for ref in ready:
                    self._handle(ref)
                for gid, rewards, counts in self.rewards.flush(generating=self.gen.inflight() > 0):
                    self._on_scored(gid, rewards, counts)
                self._live_stats(state)
                if self.train.done(ready):
                    self._on_trained()
                if self.sync.done(ready):
                    self._on_synced(state)
            self.abandoned_groups = self.gen.inflight() + len(self.gen.again)
        finally:
            state.set_scale_check(None)
            self.gen.cancel()  # groups no step will train stop generating
            self.close()
            self.fleet.shutdown()
        return self.records

    def _begin(self, total_steps: int, first_step: int) -> None:
        state = self.job.coordinator.state
        self._stale_groups_before = self.sched.counts["dropped_stale_groups"]
        self.rewards.start()
        if self.agent:
            self.runners.start(self.job)
        freeze_heap("driver")
        self.version = self.engine_version = first_step  # the trainer's weights / what every engine serves
        self.sync.begin(first_step)
        self.step, self.last_step = first_step - 1, first_step - 1 + total_steps
        self.fleet.start()
        self.recorder.begin(time.perf_counter())
        state.set_run_stats(total_steps=self.last_step, trainer_version=self.version,
                            target_engines=len(self.fleet.serving))
        state.set_scale_check(self.fleet.scale_check)
        state.set_phase("running")
        self._t_event = time.perf_counter()
        self._next_log = self.cfg.rollout.wait_log_interval_s  # seconds without an event before the next progress line

    def _operator(self, state) -> bool:
        """The operator's stop and scale target, the engines' health; whether the rollout is paused."""
        running = 1 if self.train.running else 0
        if self.stopped is None and (reason := state.stop_requested()) is not None:
            self.stopped = reason
            self.last_step = self.step + running
            log.warning("stop requested (%s): ending after step %d", reason, self.last_step)
        self.fleet.apply_scale(more_steps=self.step + running < self.last_step)
        self.fleet.check_health()
        paused = state.rollout_paused()
        if paused != self._paused_seen:  # from this iteration on no group starts, or they start again
            self._paused_seen = paused
            state.record_event("rollout_paused" if paused else "rollout_resumed",
                               f"the driver stopped starting prompt groups after step {self.step}; "
                               f"{self.gen.inflight()} generating finish and are kept" if paused else
                               f"the driver starts prompt groups again after step {self.step}")
        return paused

    def _admit(self, limit: int) -> None:
        """Drop what the next step cannot train, then start as many groups as may still be trained."""
        next_train = self.version + (1 if self.train.running else 0)
        admitted = self.sched.admit(self.engine_version, next_train, limit)
        if self.fleet.more_steps:
            self.gen.submit(self.fleet, self.engine_version, admitted)

    def _train_or_checkpoint(self, state, limit: int) -> None:
        """The trainer is free once its step is done and its weights are pushed without error (the
        engines may still be loading them), or at once when the push sends a snapshot
        (transport.overlap_push). Then: a checkpoint if one is asked for, else the next batch."""
        free = not self.train.running and not self.sync.blocks_trainer(self.version)
        if free and self.sync.idle and self.fleet.all_replacing():
            log.warning("no engine serves: engines %s join with version %d now", sorted(self.fleet.joining),
                        self.version)
            self.sync.join_replacements(self.version, self.step)
            free = False
        if free:
            self.recorder.trainer_free(time.perf_counter())
        wanted = self.checkpoint is not None and self.stopped is None and state.checkpoint_wanted()
        if wanted and free and self.sync.idle:  # a consistent point: the trainer idle, every engine on its weights
            path = self.checkpoint(self.step, self.version)
            state.checkpoint_written(self.step, self.version, path)
            wanted = False
        if not free or wanted or self.step >= self.last_step:
            return
        batch = self.sched.take_batch(self.version, limit)
        if batch is None:
            return
        record = StepRecord(self.step + 1, self.version, batch, time.perf_counter(), limit)
        self.groups["taken"] += len(batch)
        self.recorder.batch_taken(record.t_batch)
        samples = [s for g in batch for s in g.samples]
        self.last_batch, self.last_groups = samples, batch
        self.train.start(record, samples, self.sync.snapshot_for(self.version, limit))
        self.sync.arm(self.version + 1, limit, engines_idle=self.gen.inflight() == 0 and not self.gen.again)

    def _wait(self, paused: bool, limit: int) -> list:
        """The refs that finished (empty after a quiet second); progress lines while nothing happens,
        an error when nothing can happen or nothing did for ``cluster.actor_timeout_s``."""
        import ray

        from disagg.errors import RolloutError

        # Trainer and sync refs already seen done stay out (their owners keep which): ray.wait would
        # return them at once and the driver would spin (stealing a core) until their siblings finish.
        busy = self.train.waiting_refs() + self.sync.waiting_refs()
        waitables = [*self.gen.calls, *self.rewards.calls, *self.fleet.launching, *busy]
        if not waitables and not self.fleet.active():  # a sync waiting for an engine would wait forever
            raise RolloutError(f"every rollout engine died ({sorted(self.fleet.died)}) and none is being replaced "
                               f"(rollout.replace_dead_engines={self.cfg.rollout.replace_dead_engines})")
        if not waitables and (paused or self.step >= self.last_step):  # paused by the operator: wait for resume
            time.sleep(0.2)
            self._t_event = time.perf_counter()
            return []
        if not waitables:  # admission always lets an idle, synced pipeline submit: a bug if reached
            raise RolloutError(f"pipeline stalled with nothing running: {len(self.sched.ready)} groups ready "
                               f"of {self.sched.batch_groups}, staleness limit {limit}, trainer version "
                               f"{self.version}, engines on {self.engine_version}")
        done, _ = ray.wait(waitables, num_returns=1, timeout=1.0)
        if not done:
            quiet, stall_limit = time.perf_counter() - self._t_event, self.cfg.cluster.actor_timeout_s
            what = (f"{self.gen.inflight()} groups generating, {self.rewards.scoring()} scoring",
                    "running" if self.train.running else "idle", "running" if self.sync.pending else "idle")
            if quiet >= self._next_log:
                log.info("waiting %.0f s: %s, %d ready of %d, train step %s, sync %s", quiet, what[0],
                         len(self.sched.ready), self.sched.batch_groups, what[1], what[2])
                self._next_log = quiet + self.cfg.rollout.wait_log_interval_s
            if quiet > stall_limit:
                raise RolloutError(f"no progress for {stall_limit:.0f} s (cluster.actor_timeout_s): {what[0]}, "
                                   f"train step {what[1]}, sync {what[2]}")
            return []
        self._t_event, self._next_log = time.perf_counter(), self.cfg.rollout.wait_log_interval_s
        ready, _ = ray.wait(waitables, num_returns=len(waitables), timeout=0)
        self.train.noticed(ready)
        self.sync.noticed(ready)
        return ready

    # ---- one handler per kind of event ---------------------------------------------------------
    def _handle(self, ref) -> None:
        if ref in self.fleet.launching:
            self.fleet.launched(ref)
        elif ref in self.gen.calls:
            self._on_generated(ref)
        elif ref in self.rewards.calls:
            for gid, rewards, counts in self.rewards.done(ref):
                self._on_scored(gid, rewards, counts)

    def _on_generated(self, ref) -> None:
        """Groups came back from an engine or runner: to the reward workers, again, or dropped."""
        import ray

        from disagg.errors import RolloutError

        for gids, result in self.gen.take(ref):
            group = self.sched.inflight[gids[0]]
            if isinstance(result, BaseException):
                self.sched.off_engine(gids)
                if group.engine < 0:
                    if isinstance(result, ray.exceptions.RayActorError):
                        raise RolloutError(f"agent runner died while generating group {gids[0]}: "
                                           f"{brief(result)}") from result
                    raise result
                why = self.fleet.failure(group.engine, result)
                if why is None:  # the engine is healthy: a real error
                    raise result
                self.fleet.died_now(group.engine, f"{why} (while generating group(s) {gids})", gids)
                continue
            gid = gids[0]
            self.sched.generated(gid, result)
            if self.gen.run_again(gid, result):  # an agent session's engine died
                continue
            if result.dropped == "stale":  # its engine stopped it: no step could train it any more
                self.sched.stopped_stale(gid, self.cfg.algorithm.group_size)
                continue
            self.gen.served(result)
            self.recorder.generated(group.engine, sum(len(c.response_ids) for c in result.completions),
                                    time.perf_counter() - group.t_submit)
            if not self.scorer.check_group(result, self.scored):
                self.sched.finished(gid, None)
                self.groups["dropped_invalid"] += 1
                continue
            self.rewards.finished(gid, [c.final_text if c.final_text is not None else self.decode(c.response_ids)
                                        for c in result.completions], group.row)

    def _on_scored(self, gid: int, rewards: list[float], counts: dict[str, int]) -> None:
        """A group's rewards: its samples go to the ready buffer."""
        self.scored.update(counts)
        samples = self.scorer.group_samples(self.sched.inflight[gid].result, rewards, self.scored)
        self.sched.finished(gid, samples, rewards)

    def _on_trained(self) -> None:
        """The train step finished: the trainer is on the next version; the step's sync is queued, or,
        between two versions due to the engines (``algorithm.sync_interval``), the step is done."""
        record = self.train.finish()
        self.recorder.trained(record.t_train_done)
        self.version += 1
        self.step += 1
        last = self.step >= self.last_step or self.stopped is not None
        every = self.cfg.trainer.checkpoint_every
        if self.checkpoint is not None and every and self.step % every == 0 and not last:
            # Asked for now, not when the step's metrics come out (after its sync): by then the trainer
            # may have taken the next batch, and the checkpoint would slip to a later step.
            self.job.coordinator.state.schedule_checkpoint()
        if self.sync.due(self.version, record.limit, last=last):
            self.sync.trained(record)  # its sync starts at the top of the loop, once the previous one finished
        else:
            self.sync.hold(record)
            self._steps_without_sync()

    def _steps_without_sync(self) -> None:
        """Steps the engines skip (``algorithm.sync_interval``) are done at once, after any earlier step
        still syncing: metrics go out in step order."""
        for record in self.sync.released():
            self._step_done(record, SyncStats(self.engine_version, 0, 0.0, 0.0, 0, skipped=True))

    def _on_synced(self, state) -> None:
        """A sync ended: engines serve its version; its step's metrics are made and published."""
        finished = self.sync.finish(self.step, None if self.train.running else self.version)
        if finished is None:  # sent again on a rebuilt group
            return
        sync, done = finished
        self.engine_version = sync.policy_version
        if not self.train.running and self.sync.queued is None:
            # This sync's push and the engines' loads were noticed in one wake-up: the trainer was
            # blocked on the push until now, not yet counted at the top of the loop.
            self.recorder.trainer_free(time.perf_counter())
        self.fleet.synced(self.engine_version)
        if done is not None:  # else a sync that only brought new engines in
            self._step_done(done, sync)
        self._steps_without_sync()

    def _step_done(self, done, sync) -> None:
        """A step's metrics, made and published: after its sync, or at once when it had none (``sync.skipped``)."""
        state = self.job.coordinator.state
        self.groups["trained"] += len(done.groups)
        now = time.perf_counter()
        load = self.recorder.engine_rates(self.fleet.load, now)
        totals = self.recorder.run_totals(scored=self.scored, sched=self.sched, gen=self.gen, fleet=self.fleet,
                                          sync=self.sync, skipped_rows=getattr(self.data, "num_skipped", 0),
                                          prompts_lost=self.prompts_lost())
        rec = self.recorder.step_done(done, sync, now, totals)
        self._live_stats(state, trainer_version=self.version, engine_load=load)
        state.publish_metrics(done.step, rec)
        self.last_done = (done.step, done.version_trained + 1)
        if self.metrics is not None:
            self.metrics.log(done.step, rec)
        if self.progress is not None:
            self.progress.update(done.step, rec)
        if self.on_step is not None:
            self.on_step(done.step, rec)

    # ---- what the coordinator shows ---------------------------------------------------------------
    def _live_stats(self, state, **extra) -> None:
        """The run's live figures for ``disagg ctl status`` (made by the recorder)."""
        training = [r for r in (self.train.record, self.sync.queued, self.sync.syncing) if r is not None]
        state.set_run_stats(**self.recorder.live_stats(self.sched, self.gen, self.rewards, training), **extra)
