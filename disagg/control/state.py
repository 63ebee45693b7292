"""The coordinator's control state: what the driver, the engines and ``disagg ctl`` agree on.

It tracks pools, engines, the manifests of the last few announced policy versions
and which version each engine serves, and derives the committed version from the
acks. The driver calls it directly (``server.state.committed_version()``,
``server.state.set_trainer_step(n)``); the gRPC servicers in ``server.py`` call it
for engines and ``disagg ctl``. A refused request raises ``RejectedError`` with the
gRPC status the servicers answer with.

It never moves weights or samples, and never blocks: every method takes one
lock for a few dictionary operations.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import replace

import grpc

from disagg.control.types import (
    POOL_NAMES,
    ClusterStatus,
    EngineInfo,
    EngineState,
    EngineStatus,
    Event,
    LastSync,
    PoolStatus,
)
from disagg.errors import ControlError
from disagg.transport.manifest import Manifest, layout_mismatch

logger = logging.getLogger("disagg.control")


class RejectedError(ControlError):
    """The coordinator refused a request; ``code`` is the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class CoordinatorState:
    """Thread-safe control state; the gRPC servicer and the driver both call it. One class on purpose:
    one lock guards what its callers read and change together (a version's announce, acks and commit;
    the scale target beside the engines' states; pause, stop and checkpoint requests)."""

    def __init__(self, max_staleness: int = 0, run_dir: str = "", num_manifests_kept: int = 4):
        if num_manifests_kept < 1:
            raise ValueError(f"num_manifests_kept must be >= 1, got {num_manifests_kept}")
        self._lock = threading.Lock()
        self._pools: dict[str, PoolStatus] = {}
        self._engines: dict[int, EngineStatus] = {}
        # policy_version -> (manifest, layout digest), oldest first, at most num_manifests_kept.
        self._manifests: OrderedDict[int, tuple[Manifest, str]] = OrderedDict()
        self._num_manifests_kept = num_manifests_kept
        self._latest_version: int | None = None
        self._trainer_step = 0
        self._max_staleness = 0
        self.set_max_staleness(max_staleness)
        self._run_dir = run_dir
        self._started_unix_s = time.time()
        # Driver-side run state (the pipeline publishes it; Ops calls steer it).
        self._run = {"trainer_version": 0, "buffer_groups": 0, "inflight_groups": 0, "training_groups": 0,
                     "phase": "starting", "total_steps": 0, "target_engines": 0}
        self._engine_load: dict[int, tuple[int, float]] = {}  # engine id -> (groups in flight, tokens/s)
        self._paused = False
        # ScaleRollout: the driver registers a check (n -> None or why n engines cannot run) and
        # polls the target; None until a scale request arrives.
        self._scale_check = None
        self._expected: dict[int, tuple] = {}  # engine id -> its model's TensorSpecs (trainer names)
        self._layouts_checked: set[tuple[str, int]] = set()  # (manifest layout digest, engine id) that agree
        self._members: set[int] | None = None
        self._scale_target: int | None = None
        self._stop_reason: str | None = None
        self._checkpoint_waiters = 0  # Checkpoint calls waiting for the next written checkpoint
        self._last_checkpoint: tuple[int, int, str] | None = None  # (step, version, path)
        self._checkpoint_seq = 0
        self._checkpoint_scheduled = False  # a periodic checkpoint is due (nobody waits for it)
        self._events: deque[Event] = deque(maxlen=100)  # engine deaths, replacements, sync retries
        self._dead_kept = 8  # dead engines stay in the status (state DEAD, why in the message) up to this many
        self._metrics: list[tuple[int, dict[str, float]]] = []
        self._metrics_kept = 10_000
        self._changed = threading.Condition(self._lock)  # metrics, checkpoints, phase
        # WatchMetrics streams and Checkpoint calls each hold a server thread while they wait;
        # past this many the rest get RESOURCE_EXHAUSTED, so engines' and the trainer's calls
        # always find a thread.
        self._blocking = 0
        self.max_blocking_calls = 16
        # Told of each published step and event, outside the lock (the Prometheus exporter).
        self._observers: list = []
        self._metrics_url = ""

    def add_observer(self, observer) -> None:
        """``observer.step_published(step, values)`` and ``observer.event_recorded(event)`` are called from
        then on, in the publishing thread, after the state has changed."""
        self._observers.append(observer)

    def set_metrics_url(self, url: str) -> None:
        with self._lock:
            self._metrics_url = url

    def register_pool(self, pool: PoolStatus) -> None:
        if pool.name not in POOL_NAMES:
            raise RejectedError(grpc.StatusCode.INVALID_ARGUMENT, f"pool name must be one of {POOL_NAMES}, got {pool.name!r}")
        with self._lock:
            self._pools[pool.name] = replace(pool, registered_unix_s=time.time())
        logger.info("[coordinator] pool %r registered: %d bundles of %s, %d workers", pool.name,
                    pool.num_bundles, pool.bundle_resources, pool.num_workers)

    def register_engine(self, info: EngineInfo) -> None:
        status = EngineStatus(info.engine_id, info.state, info.node_ip, info.pid, info.address, 0, time.time())
        with self._lock:
            previous = self._engines.get(info.engine_id)
            self._engines[info.engine_id] = status
            self._expected[info.engine_id] = tuple(info.expected_tensors)
            self._layouts_checked = {k for k in self._layouts_checked if k[1] != info.engine_id}
        again = f" (replacing pid {previous.pid} on {previous.node_ip})" if previous else ""
        logger.info("[coordinator] engine %d registered from %s pid %d in %s%s", info.engine_id, info.node_ip,
                    info.pid, info.state.value, again)

    def update_engine_state(self, engine_id: int, state: EngineState, message: str = "") -> None:
        with self._lock:
            old = self._engine(engine_id)
            self._engines[engine_id] = replace(old, state=state, message=message, last_update_unix_s=time.time())
        # READY <-> SYNCING flips every step: keep those at debug level.
        routine = {old.state, state} <= {EngineState.READY, EngineState.SYNCING}
        log = logger.warning if state is EngineState.DEAD else (logger.debug if routine else logger.info)
        log("[coordinator] engine %d %s -> %s%s", engine_id, old.state.value, state.value, f": {message}" if message else "")

    def announce_version(self, manifest: Manifest, trainer_step: int) -> None:
        """Record a new policy version; re-announcing the latest with the same layout is a no-op."""
        version, digest = manifest.policy_version, manifest.layout_digest()
        with self._lock:
            latest = self._latest_version
            if latest is not None and version < latest:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"policy_version {version} announced after {latest}; versions must not go back")
            if version == latest and self._manifests[version][1] != digest:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"policy_version {version} re-announced with layout digest {digest}, "
                                    f"announced before with {self._manifests[version][1]}")
            self._check_layout_locked(manifest, digest)
            self._manifests[version] = (manifest, digest)
            while len(self._manifests) > self._num_manifests_kept:
                self._manifests.popitem(last=False)
            self._latest_version = version
            self._trainer_step = trainer_step
        logger.debug("[coordinator] policy_version %d announced at trainer step %d: %d tensors in %d buckets, "
                    "%d bytes, layout %s", version, trainer_step, len(manifest.tensors), len(manifest.buckets),
                    manifest.total_bytes, digest)

    def _check_layout_locked(self, manifest: Manifest, digest: str) -> None:
        """Refuse a version whose tensors disagree with a live engine's model: before any byte is
        sent, so every engine keeps serving the version it has."""
        for engine_id, expected in self._expected.items():
            engine = self._engines.get(engine_id)
            if not expected or engine is None or not engine.state.is_live or (digest, engine_id) in self._layouts_checked:
                continue
            problems = layout_mismatch(manifest.tensors, expected)
            if problems:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"policy_version {manifest.policy_version} does not fit engine {engine_id}'s model "
                                    f"({len(manifest.tensors)} tensors announced, the model has {len(expected)}): "
                                    + "; ".join(problems) + ". Nothing was sent; the engines keep serving version "
                                    f"{self._committed_locked()}. Is the trainer's model the engines' (model.path)?")
            self._layouts_checked.add((digest, engine_id))

    def get_manifest(self, policy_version: int) -> Manifest:
        with self._lock:
            if policy_version not in self._manifests:
                raise RejectedError(grpc.StatusCode.NOT_FOUND, self._unknown_version(policy_version))
            return self._manifests[policy_version][0]

    def ack_version(self, engine_id: int, policy_version: int, layout_digest: str) -> int:
        """Record that an engine serves ``policy_version``; return the committed version."""
        with self._lock:
            engine = self._engine(engine_id)
            if policy_version not in self._manifests:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"engine {engine_id} acked: {self._unknown_version(policy_version)}")
            expected = self._manifests[policy_version][1]
            if layout_digest != expected:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"engine {engine_id} acked policy_version {policy_version} with layout digest "
                                    f"{layout_digest!r}, but the announced manifest's digest is {expected!r}")
            self._engines[engine_id] = replace(engine, policy_version=policy_version, last_update_unix_s=time.time())
            committed = self._committed_locked()
        logger.debug("[coordinator] engine %d serves policy_version %d; committed version %d", engine_id,
                    policy_version, committed)
        return committed

    def committed_version(self) -> int:
        with self._lock:
            return self._committed_locked()

    def latest_version(self) -> int:
        with self._lock:
            return self._latest_version or 0

    def set_trainer_step(self, trainer_step: int) -> None:
        with self._lock:
            self._trainer_step = trainer_step

    def set_max_staleness(self, value: int) -> int:
        if value < 0:
            raise RejectedError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_staleness must be >= 0 (0 means fully on-policy), got {value}")
        with self._lock:
            old, self._max_staleness = self._max_staleness, value
        if old != value:
            logger.info("[coordinator] max_staleness %d -> %d", old, value)
        return value

    def max_staleness(self) -> int:
        with self._lock:
            return self._max_staleness

    # ---- the run, as the driver publishes it --------------------------------------------
    def set_run_stats(self, *, trainer_version: int | None = None, buffer_groups: int | None = None,
                      inflight_groups: int | None = None, total_steps: int | None = None,
                      engine_load: dict[int, tuple[int, float]] | None = None,
                      target_engines: int | None = None, training_groups: int | None = None) -> None:
        with self._lock:
            for k, v in (("trainer_version", trainer_version), ("buffer_groups", buffer_groups),
                         ("inflight_groups", inflight_groups), ("total_steps", total_steps),
                         ("target_engines", target_engines), ("training_groups", training_groups)):
                if v is not None:
                    self._run[k] = v
            if engine_load is not None:
                self._engine_load = dict(engine_load)

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self._run["phase"] = phase
            self._changed.notify_all()

    def _phase_locked(self) -> str:
        phase = self._run["phase"]
        if phase == "running" and self._stop_reason is not None:
            return "stopping"
        if phase == "running" and self._paused:
            return "paused"
        return phase

    def publish_metrics(self, step: int, record: dict) -> None:
        values = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        with self._lock:
            self._metrics.append((step, values))
            del self._metrics[: max(0, len(self._metrics) - self._metrics_kept)]
            self._changed.notify_all()
        for observer in self._observers:
            observer.step_published(step, values)

    def watch_metrics(self, from_step: int, active, poll_s: float = 1.0):
        """Yield (step, values) from ``from_step`` on (0: from the next step) until the run stops or ``active()``
        is false."""
        with self._lock:
            self._enter_blocking("WatchMetrics")
            nxt = from_step if from_step > 0 else (self._metrics[-1][0] + 1 if self._metrics else 1)
        try:
            yield from self._watch(nxt, active, poll_s)
        finally:
            with self._lock:
                self._blocking -= 1

    def _enter_blocking(self, what: str) -> None:
        if self._blocking >= self.max_blocking_calls:
            raise RejectedError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: {self._blocking} waiting calls "
                                f"(streams and checkpoints) already; close one and retry")
        self._blocking += 1

    def _watch(self, nxt: int, active, poll_s: float):
        while active():
            with self._lock:
                batch = [m for m in self._metrics if m[0] >= nxt]
                if not batch:
                    if self._run["phase"] in ("stopped", "failed"):
                        return
                    self._changed.wait(poll_s)
                    continue
            for step, values in batch:
                yield step, values
                nxt = step + 1

    # ---- operator commands -------------------------------------------------------------
    def pause_rollout(self, reason: str = "") -> str:
        with self._lock:
            self._check_running("pause the rollout")
            if self._paused:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION, "rollout is already paused "
                                    "(ResumeRollout to continue)")
            self._paused = True
        logger.warning("[ops] rollout paused%s", f": {reason}" if reason else "")
        return "rollout paused: no new prompt groups start; groups in flight finish and are kept"

    def resume_rollout(self, reason: str = "") -> str:
        with self._lock:
            if not self._paused:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION, "rollout is not paused")
            self._paused = False
        logger.warning("[ops] rollout resumed%s", f": {reason}" if reason else "")
        return "rollout resumed"

    def rollout_paused(self) -> bool:
        with self._lock:
            return self._paused

    def set_scale_check(self, check) -> None:
        """The driver's ``check(num_engines) -> None | str`` (why that many engines cannot run)."""
        with self._lock:
            self._scale_check = check

    def request_scale(self, num_engines: int, reason: str = "") -> str:
        """Ask the driver to grow or shrink the rollout pool to ``num_engines`` (it acts at the next step)."""
        if num_engines < 1:
            raise RejectedError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"num_engines must be >= 1 (a job needs an engine to generate), got {num_engines}")
        with self._lock:
            self._check_running("scale the rollout pool")
            check, current = self._scale_check, self._run["target_engines"]
        if check is None:
            raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                "this job cannot scale its rollout pool (no training pipeline is running yet)")
        why = check(num_engines)
        if why:
            raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION, why)
        with self._lock:
            self._scale_target = num_engines
            self._run["target_engines"] = num_engines
        logger.warning("[ops] rollout pool scaling %d -> %d engines%s", current, num_engines,
                       f": {reason}" if reason else "")
        if num_engines == current:
            return f"the rollout pool already has (or is scaling to) {num_engines} engines"
        how = ("new engines start on dummy weights, join at the next weight sync and then take prompts"
               if num_engines > current else
               "engines stop taking prompts, finish the groups they have and leave at the next weight sync")
        return f"scaling the rollout pool from {current} to {num_engines} engines: {how}"

    def set_scale_target(self, num_engines: int, why: str) -> None:
        """The driver settled the pool at ``num_engines`` instead of the target asked for (e.g. an engine
        failed to start); the status shows it and the driver stops trying."""
        with self._lock:
            self._scale_target = num_engines
            self._run["target_engines"] = num_engines
        logger.warning("[ops] rollout pool target is now %d engines: %s", num_engines, why)

    def scale_target(self) -> int | None:
        with self._lock:
            return self._scale_target

    def remove_engine(self, engine_id: int) -> None:
        """An engine left the pool (scaled down): it no longer appears in the status."""
        with self._lock:
            gone = self._engines.pop(engine_id, None)
            self._expected.pop(engine_id, None)
            self._engine_load.pop(engine_id, None)
        if gone is not None:
            logger.info("[coordinator] engine %d left the pool", engine_id)

    def record_event(self, kind: str, message: str) -> None:
        """Something the operator should see in ``disagg ctl status`` (the last 100 are kept)."""
        event = Event(time.time(), kind, message)
        with self._lock:
            self._events.append(event)
        logger.warning("[event] %s: %s", kind, message)
        for observer in self._observers:
            observer.event_recorded(event)

    def engine_died(self, engine_id: int, why: str) -> None:
        """An engine is gone (dead or stuck and killed): DEAD in the status, out of the commit."""
        with self._lock:
            old = self._engines.get(engine_id)
            if old is not None:
                self._engines[engine_id] = replace(old, state=EngineState.DEAD, message=why[:500],
                                                   last_update_unix_s=time.time())
            self._expected.pop(engine_id, None)
            self._engine_load.pop(engine_id, None)
            if self._members is not None:
                self._members.discard(engine_id)
            dead = [i for i, e in self._engines.items() if e.state is EngineState.DEAD]
            for i in dead[: max(0, len(dead) - self._dead_kept)]:
                del self._engines[i]
        self.record_event("engine_dead", f"engine {engine_id}: {why}")

    def request_stop(self, reason: str = "") -> str:
        with self._lock:
            self._check_running("stop")
            self._stop_reason = reason or "requested over gRPC"
        logger.warning("[ops] stop requested: %s", self._stop_reason)
        return "stopping: the step in progress finishes, a checkpoint is written, then the job exits 0"

    def stop_requested(self) -> str | None:
        with self._lock:
            return self._stop_reason

    def request_checkpoint(self, timeout_s: float) -> tuple[int, int, str]:
        """Block until the driver writes the next checkpoint; return (step, version, path)."""
        with self._lock:
            self._check_running("checkpoint")
            self._enter_blocking("Checkpoint")
            seq = self._checkpoint_seq
            self._checkpoint_waiters += 1
            try:
                ok = self._changed.wait_for(lambda: self._checkpoint_seq > seq or self._run["phase"] in
                                            ("stopped", "failed"), timeout=timeout_s)
            finally:
                self._checkpoint_waiters -= 1
                self._blocking -= 1
            if self._checkpoint_seq > seq:
                return self._last_checkpoint
            if not ok:
                raise RejectedError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no checkpoint written within "
                                    f"{timeout_s:.0f} s (the step in progress has not finished)")
            raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION, f"the job {self._run['phase']} before "
                                "writing the checkpoint")

    def checkpoint_wanted(self) -> bool:
        with self._lock:
            return self._checkpoint_waiters > 0 or self._checkpoint_scheduled

    def checkpoint_written(self, step: int, policy_version: int, path: str) -> None:
        with self._lock:
            self._last_checkpoint = (step, policy_version, path)
            self._checkpoint_seq += 1
            self._checkpoint_scheduled = False
            self._changed.notify_all()

    def schedule_checkpoint(self) -> None:
        """Ask for the next checkpoint without waiting for it (the driver's periodic checkpoints)."""
        with self._lock:
            self._checkpoint_scheduled = True

    def _check_running(self, what: str) -> None:
        phase = self._phase_locked()
        if phase in ("stopping", "stopped", "failed"):
            raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot {what}: the job is {phase}")

    def status(self) -> ClusterStatus:
        with self._lock:
            load = {i: self._engine_load.get(i, (0, 0.0)) for i in self._engines}
            engines = tuple(replace(self._engines[i], inflight_groups=load[i][0], tokens_per_s=load[i][1])
                            for i in sorted(self._engines))
            return ClusterStatus(
                pools=tuple(self._pools[n] for n in sorted(self._pools)),
                engines=engines,
                latest_version=self._latest_version or 0,
                committed_version=self._committed_locked(),
                max_staleness=self._max_staleness,
                trainer_step=self._trainer_step,
                run_dir=self._run_dir,
                started_unix_s=self._started_unix_s,
                trainer_version=self._run["trainer_version"],
                buffer_groups=self._run["buffer_groups"],
                inflight_groups=self._run["inflight_groups"],
                rollout_paused=self._paused,
                phase=self._phase_locked(),
                total_steps=self._run["total_steps"],
                target_engines=self._run["target_engines"],
                events=tuple(self._events),
                training_groups=self._run["training_groups"],
                metrics_url=self._metrics_url,
                last_sync=next((x for step, m in reversed(self._metrics)
                                if (x := LastSync.from_metrics(step, m)) is not None), None),
            )

    def _committed_locked(self) -> int:
        # Engines outside the transport group (started by a scale-up, joining at the next sync)
        # receive nothing yet: they do not hold the committed version down.
        live = [e.policy_version for i, e in self._engines.items()
                if e.state.is_live and (self._members is None or i in self._members)]
        return min(live) if live else 0

    def set_transport_members(self, engine_ids: list[int]) -> None:
        """The engines in the transport group (the driver sets it at every rebuild); only they count
        towards the committed version. Until it is set, every registered engine does."""
        with self._lock:
            self._members = set(engine_ids)

    def _engine(self, engine_id: int) -> EngineStatus:
        if engine_id not in self._engines:
            raise RejectedError(grpc.StatusCode.NOT_FOUND, f"engine {engine_id} is not registered "
                                f"(registered: {sorted(self._engines)})")
        return self._engines[engine_id]

    def _unknown_version(self, policy_version: int) -> str:
        kept = list(self._manifests)
        if self._latest_version is not None and policy_version < kept[0]:
            return (f"policy_version {policy_version} is older than every kept manifest {kept} "
                    f"(only the last {self._num_manifests_kept} are kept)")
        return f"policy_version {policy_version} was never announced (kept: {kept})"
