"""The weight sync's one owner: the driver's side of moving a policy version from the trainer to
every engine, and all the state that takes.

``WeightSync`` holds what lives from one sync to the next - the transport groups' epoch, the
trainer's manifest (asked of it once: its layout never changes), an armed receive and the driver's
words to it (``transport.signals``), the last sync's end-to-end time - and has a handful of verbs:
``build`` the groups, ``arm`` the engines' (and the trainer's) side before the version exists,
``disarm``, ``start`` a sync (announce, then the word or the pushes), ``finish`` it (acks, the
coordinator's commit, ``SyncStats``). The trainer's side is ``trainer/push.py``, the engines'
``rollout/engine_receive.py``, the wire ``transport/``; ``Job`` owns one ``WeightSync`` and hands its
verbs on. No parameter byte passes through the driver: it only announces, signals and waits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from disagg.config import Config
from disagg.errors import TransportError
from disagg.logs import ray_get_logged
from disagg.rollout.types import sync_timeline
from disagg.transport.manifest import Manifest, ManifestCache

if TYPE_CHECKING:
    from disagg.transport.model_transfer import Arm

log = logging.getLogger("disagg.job")


@dataclass
class SyncStats:
    policy_version: int
    bytes: int
    seconds: float  # announce + broadcast + every engine's load and acknowledgement, seen by the driver
    send_s: float  # the slowest sending trainer rank's own time on the wire (packing included)
    num_buckets: int
    engine_phases: dict[str, float] = field(default_factory=dict)  # each phase's seconds, the slowest engine's
    timeline: dict[str, float] = field(default_factory=dict)  # each event's seconds after the announce (TIMELINE)
    armed: bool = False  # the engines' receives waited on the group before the announce (WeightSync.arm)
    skipped: bool = False  # no sync: the step's version was not due to the engines (algorithm.sync_interval)
    wire_bytes: int | None = None  # what went on the wire (< bytes for a delta, transport.delta); None: bytes
    changed_fraction: float | None = None  # of the elements, against the engines' version (a delta); None: dense

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class ArmedReceive:
    """Engines waiting on the transport group for a version the trainer does not hold yet (``WeightSync.arm``)."""

    arm: Arm  # the armed sync, as every party of it was handed it
    policy_version: int
    refs: list  # every engine's receive
    engine_ids: tuple[int, ...]
    epoch: int  # the transport group's; a rebuilt group ends the wait
    pushes: list = field(default_factory=list)  # the trainer ranks' armed pushes, waiting for the go (or none)


@dataclass
class PendingSync:
    policy_version: int
    t0: float
    refs: list  # trainer ranks' pushes, then every engine's receive
    num_trainer_refs: int = 0
    engine_ids: tuple[int, ...] = ()  # the receiving engines, in the order of their refs
    pushed: bool | None = None  # the trainer's side finished without error (None: not known yet)
    from_snapshot: bool = False  # sent from a copy: the trainer may train while it runs
    wall0: float = 0.0  # the announce's unix time (the parties' clock readings are placed after it)
    armed: bool = False  # the engines' receives were waiting on the group before the announce (WeightSync.arm)

    @property
    def engine_refs(self) -> dict[int, object]:
        """Engine id -> its receive's ref."""
        return dict(zip(self.engine_ids, self.refs[self.num_trainer_refs:]))

    @property
    def trainer_refs(self) -> list:
        """The trainer ranks' pushes: once done, the trainer may change its weights again."""
        return self.refs[: self.num_trainer_refs]


def _any_done(refs: list) -> bool:
    import ray

    return bool(refs) and bool(ray.wait(refs, num_returns=1, timeout=0)[0])


class WeightSync:
    """The driver's side of every sync of a job (see the module's docstring). ``trainer`` and
    ``rollout`` are the job's pools (their members may change between syncs: ``build`` again),
    ``coordinator`` its control plane, whose state announces, acks and commits versions."""

    def __init__(self, cfg: Config, backend: str, trainer, rollout, coordinator) -> None:
        self.cfg, self.backend = cfg, backend
        self.trainer, self.rollout, self.coordinator = trainer, rollout, coordinator
        self.transport_epoch = 0
        self._manifest_cache = ManifestCache()  # the trainer's manifest (asked of it at the first sync)
        self.armed: ArmedReceive | None = None
        self._num_arms = 0  # how many syncs were armed: the last one's Arm.id
        self._last_sync_s: float | None = None  # the last sync's announce -> serving (``sync_stats``)
        self._signals = None  # the driver's word to armed pushes and receives (transport.signals: signals.py)
        self.signals = cfg.transport.signals  # how the groups' words travel (set_signals: benchmarks)

    def close(self, timeout_s: float = 10.0) -> None:
        """Call off an armed receive (the engines' workers return before their actors are stopped)
        and close the driver's words."""
        if self.armed is not None:
            self.disarm(timeout_s=timeout_s)
        if self._signals is not None:
            self._signals.close()
            self._signals = None

    def build(self) -> None:
        """(Re)build the transport groups: one per sending trainer rank, each with every engine worker."""
        from disagg.transport.model_transfer import source_groups_needed

        self.disarm()  # an armed receive waits on the group being replaced
        if self._signals is not None:
            self._signals.close()
        self._signals = None
        self.transport_epoch += 1
        t = self.cfg.transport.timeout_s
        n_groups = source_groups_needed(self.cfg.transport.source, self.cfg.trainer.num_workers)
        world = 1 + self.rollout.num_workers
        endpoints = [(*self.trainer.transport_endpoint(r), f"disagg-transport-{self.transport_epoch}-s{r}")
                     for r in range(n_groups)]
        t0 = time.perf_counter()
        refs = [self.trainer.transport_method(r, "init_transport").remote(host=h, port=p, world_size=world,
                                                                          backend=self.backend, timeout_s=t,
                                                                          group_name=name, signals=self.signals)
                for r, (h, p, name) in enumerate(endpoints)]
        refs += self.rollout.init_transport_async(endpoints, world, self.backend, t, self.signals)
        self.coordinator.state.set_transport_members(self.rollout.engine_ids)
        what = f"transport rendezvous ({n_groups} group(s) of {world} ranks, epoch {self.transport_epoch})"
        try:
            ray_get_logged(refs, what=what, timeout_s=t + 30, log=log)
        except TimeoutError as e:
            raise TransportError(f"{what}: {e}") from e
        if self.trainer.overlap_push:  # armed pushes wait on the transport thread for the driver's word
            from disagg.transport.signals import driver_signals

            self._signals = driver_signals(endpoints, world, t, self.signals)
        log.info("transport up: %d group(s) of %d ranks, backend %s, source %s, words via %s, %.2fs", n_groups,
                 world, self.backend, self.cfg.transport.source, self.signals, time.perf_counter() - t0)

    def set_signals(self, signals: str) -> None:
        """Benchmarks: the groups' words travel by ``signals`` from now on (``transport.signals``: socket or
        store), the transport rebuilt for it (a new epoch); each way's syncs side by side in one run
        (``disagg bench vllm-sync --signals``). Call only between syncs."""
        from disagg.transport.signals import SIGNALS

        if signals not in SIGNALS:
            raise ValueError(f"set_signals: transport.signals must be one of {SIGNALS}, got {signals!r}")
        if signals != self.signals:
            self.signals = signals
            self.build()

    def sync(self, policy_version: int, trainer_step: int) -> SyncStats:
        """Announce ``policy_version`` and broadcast it to every engine; returns when all acked."""
        return self.finish(self.start(policy_version, trainer_step))

    def forget_manifest(self) -> None:
        """The trainer's bucket layout changed (a benchmark re-planned it: ``disagg.bench.actors``): its
        manifest is asked of it again at the next sync."""
        self._manifest_cache.forget()

    def arm(self, policy_version: int, timeout_s: float) -> None:
        """Put every engine's receive of ``policy_version`` on the transport group now, before the trainer
        has the version (while the engines would be idle: a sync loop's train step). The engine stops
        its steps while it waits (``timeout_s`` at most; the trainer dying ends it), and a call into vLLM's
        engine core (a version query, a generation) waits behind it until the sync. With
        ``transport.overlap_push`` the trainer's push is put in place too, on its transport thread,
        waiting in the group's store for the driver's word (the step's end packs its first buckets:
        ``EarlyPack``). ``start`` of that version then only
        sets that word after the announce: no Ray, engine-core or trainer dispatch between the announce
        and the wire (without overlap_push it calls the trainer, whose push wakes the engines).
        ``disarm`` calls it off."""
        from disagg.transport.model_transfer import Arm

        if self.armed is not None:
            raise TransportError(f"an armed receive (version {self.armed.policy_version}) is already waiting")
        digest = self._manifest_at(policy_version).layout_digest()
        self._num_arms += 1
        # With the trainer's push armed too (push_waits), its header goes out now and every worker takes
        # it before the word (a dense push's); after the word, only buckets.
        arm = Arm(self._num_arms, timeout_s, push_waits=self._signals is not None)
        refs = self.rollout.receive_weights_async(policy_version, digest=digest, ack=False,
                                                  max_staleness=self.coordinator.state.max_staleness(), arm=arm)
        pushes = (self.trainer.push_weights_async(policy_version, False, arm, last_sync_s=self._take_last_sync_s())
                  if arm.push_waits else [])
        self.armed = ArmedReceive(arm, policy_version, refs, tuple(self.rollout.engine_ids), self.transport_epoch,
                                  pushes)

    def _manifest_at(self, policy_version: int) -> Manifest:
        """The trainer's manifest at ``policy_version``, asked of it once (its layout changes only when
        a benchmark re-plans it: ``forget_manifest``)."""
        return self._manifest_cache.made_at(policy_version, lambda: self.trainer.manifest(policy_version))

    def disarm(self, timeout_s: float | None = None) -> None:
        """Call off the armed receive, if any: the trainer tells the engines, which return having loaded
        nothing. A party that cannot be told (dead, its group gone) is left to its own timeout."""
        armed, self.armed = self.armed, None
        if armed is None:
            return
        timeout_s = self.cfg.transport.timeout_s if timeout_s is None else timeout_s
        try:
            if armed.pushes:  # the trainer's armed push calls the engines' receives off itself
                from disagg.transport.model_transfer import ARM_CANCEL

                self._go(armed, ARM_CANCEL)
            else:
                ray_get_logged(self.trainer.disarm_async(armed.arm), what=f"calling off armed receive "
                               f"{armed.arm.id}", timeout_s=timeout_s, log=log)
            ray_get_logged(armed.pushes + armed.refs, what=f"armed receive {armed.arm.id} to return",
                           timeout_s=timeout_s, log=log)
        except Exception as e:  # noqa: BLE001 - a dead party is the caller's to handle: the next sync finds it
            log.warning("armed receive of version %d not called off cleanly: %s", armed.policy_version,
                        str(e).splitlines()[0][:300])

    def _go(self, armed: ArmedReceive, word: str) -> None:
        """The driver's word (``ARM_SEND`` or ``ARM_CANCEL``) to every party of an armed sync at once,
        through each group's store: the trainer's armed pushes (``go_key``) and the engines' armed
        receives (``arm_key``), so that the engines wake beside the trainer rather than one store hop
        after it. A store that is gone means its trainer rank died: its push's ref says so."""
        from disagg.transport.model_transfer import arm_key, go_key

        for failed in self._signals.signal({go_key(armed.arm.id): word, arm_key(armed.arm.id): word}):
            log.warning("armed push %d: could not say %r (%s)", armed.arm.id, word, failed)

    def start(self, policy_version: int, trainer_step: int, from_snapshot: bool = False) -> PendingSync:
        """Announce ``policy_version`` and start its broadcast; engines keep generating until they
        receive (each pauses its in-flight requests only while it loads). ``finish`` waits.
        ``from_snapshot``: the trainer sends the copy its step took (``transport.overlap_push``).

        One message per party: the coordinator lives in this process, so the version is announced
        to it directly, with the trainer's manifest (asked of it once: its layout never changes);
        each engine is told the layout's digest, and fetches the manifest only when it does not
        hold that layout yet; the engines' acks come back with their reports (``finish``). Where
        the engines' receives of this version are armed (``arm``), only the trainer is called."""
        armed = self.armed
        if armed is not None and ((armed.policy_version, armed.engine_ids, armed.epoch) != (
                policy_version, tuple(self.rollout.engine_ids), self.transport_epoch)
                or (armed.pushes and from_snapshot) or _any_done(armed.refs + armed.pushes)):
            # armed for another version, other engines or the live weights, or a party ended (failed) meanwhile
            # (checked before the announce: whether the arming holds is no part of this version's sync)
            self.disarm()
            armed = None
        t0, wall0 = time.perf_counter(), time.time()
        manifest = self._manifest_at(policy_version)
        try:
            self.coordinator.state.announce_version(manifest, trainer_step)  # may refuse it: before any byte moves
        except BaseException:
            self.disarm()
            raise
        self.armed = None
        if armed is not None and armed.pushes:  # every party waits on the group: the driver's word starts it
            from disagg.transport.model_transfer import ARM_SEND

            self._go(armed, ARM_SEND)
            pushes, receives = armed.pushes, armed.refs
        elif armed is not None:  # the engines wait on the group: the trainer's push wakes them
            pushes = self.trainer.push_weights_async(policy_version, from_snapshot, armed.arm,
                                                     last_sync_s=self._take_last_sync_s())
            receives = armed.refs
        else:
            # The engines first: their way onto the group (the actor, then vLLM's engine core into its
            # worker) is longer than the trainer's, and the wire starts when the last party is on it.
            receives = self.rollout.receive_weights_async(policy_version, digest=manifest.layout_digest(), ack=False,
                                                          max_staleness=self.coordinator.state.max_staleness())
            pushes = self.trainer.push_weights_async(policy_version, from_snapshot, last_sync_s=self._take_last_sync_s())
        return PendingSync(policy_version, t0, pushes + receives, len(pushes), tuple(self.rollout.engine_ids),
                           from_snapshot=from_snapshot, wall0=wall0, armed=armed is not None)

    def finish(self, pending: PendingSync) -> SyncStats:
        """Wait for every party of a started sync; one TransportError naming each failed party."""
        policy_version, refs = pending.policy_version, pending.refs
        names = [f"trainer rank {w}" for w in range(len(self.trainer.workers))]
        names += [f"engine {e}" for e in pending.engine_ids]
        try:
            outs = ray_get_logged(refs, what=f"weight sync v{policy_version}", timeout_s=self.cfg.transport.timeout_s + 30,
                                  log=log)
        except Exception as e:  # noqa: BLE001 - re-raised as one TransportError naming every failed party
            raise TransportError(f"weight sync of version {policy_version} failed: "
                                 f"{self._sync_failures(refs, names, e)}") from e
        n = len(self.trainer.workers)
        for report in outs[n:]:  # every engine serves the version: the coordinator commits it
            self.coordinator.state.ack_version(report.engine_id, policy_version, report.layout_digest)
        committed = self.coordinator.state.committed_version()
        if committed != policy_version:
            raise TransportError(f"after sync of version {policy_version} the committed version is {committed}")
        stats = sync_stats(pending, outs[:n], outs[n:])
        # transport.delta=auto: the next push tells its chooser what this one cost end to end (the
        # last engine serving, by the parties' clocks), the receivers' work included
        self._last_sync_s = stats.timeline.get("worker_out") or stats.seconds
        return stats

    def _take_last_sync_s(self) -> float | None:
        """The last finished sync's announce -> serving, once (a push after a failed sync gets none)."""
        last, self._last_sync_s = self._last_sync_s, None
        return last

    def _sync_failures(self, refs: list, names: list[str], first: Exception) -> str:
        """What each party of a failed sync reported (its peers fail within the transport timeout)."""
        import ray

        ray.wait(refs, num_returns=len(refs), timeout=self.cfg.transport.timeout_s + 5)
        parts = []
        for name, ref in zip(names, refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                parts.append(f"{name}: still running")
            except ray.exceptions.RayActorError as e:
                parts.append(f"{name}: actor died ({str(e).splitlines()[0][:200]})")
            except Exception as e:  # noqa: BLE001 - reported, not swallowed: the caller raises
                parts.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        return "; ".join(parts) or f"{type(first).__name__}: {first}"


def sync_stats(pending: PendingSync, sent: list[dict], received: list = ()) -> SyncStats:
    """A finished sync's figures from what the trainer ranks' pushes returned and the engines'
    ``SyncReport``s (each phase: the slowest engine's seconds)."""
    phases: dict[str, float] = {}
    for report in received:
        for k, v in getattr(report, "phases", {}).items():
            phases[k] = max(phases.get(k, 0.0), v)
    seconds = time.perf_counter() - pending.t0
    dense = sum(int(o["bytes"]) for o in sent)
    deltas = [o for o in sent if o.get("changed_fraction") is not None]  # each sending rank's, by its bytes
    changed = (sum(o["changed_fraction"] * int(o["bytes"]) for o in deltas) / max(1, dense)
               if deltas and len(deltas) == sum(1 for o in sent if int(o["bytes"])) else None)
    return SyncStats(pending.policy_version, dense, seconds,
                     max(float(o.get("send_s", 0.0)) for o in sent), sum(int(o["num_buckets"]) for o in sent),
                     phases, sync_timeline(pending.wall0, seconds, sent, received), pending.armed,
                     wire_bytes=sum(int(o.get("wire_bytes", o["bytes"])) for o in sent), changed_fraction=changed)

