"""A running disagg job: coordinator, both pools, and the transport group between them.

``Job.start`` brings everything up in order - coordinator (gRPC), Ray, the two
placement groups, trainer workers, rollout engines (dummy weights), then the
dedicated transport group - and ``sync_weights`` moves one policy version from
trainer rank 0 to every engine worker. The driver only orchestrates: no
parameter byte passes through it or through Ray's object store.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from disagg.cluster import Pools, connect, create_pools
from disagg.config import Config, resolve_backend, resolve_device, shares_gpus
from disagg.errors import TransportError
from disagg.logs import ray_get_logged
from disagg.rollout.pool import RolloutPool
from disagg.rollout.types import sync_timeline
from disagg.trainer.group import TrainerGroup

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
    armed: bool = False  # the engines' receives waited on the group before the announce (Job.arm_sync)
    skipped: bool = False  # no sync: the step's version was not due to the engines (algorithm.sync_interval)
    wire_bytes: int | None = None  # what went on the wire (< bytes for a delta, transport.delta); None: bytes
    changed_fraction: float | None = None  # of the elements, against the engines' version (a delta); None: dense

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class ArmedReceive:
    """Engines waiting on the transport group for a version the trainer does not hold yet (``Job.arm_sync``)."""

    arm_id: int
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
    armed: bool = False  # the engines' receives were waiting on the group before the announce (Job.arm_sync)

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


class Job:
    def __init__(self, cfg: Config, run_dir: Path, model_path: Path | str):
        self.cfg = cfg
        self.run_dir = run_dir
        # The model the actors load: a local directory, or the checkpoint a resumed run starts from
        # (a path or an fsspec URL, which each actor copies to its node: disagg.storage.local_copy).
        self.model_path = model_path
        self.coordinator = None
        self.token: str | None = None  # the job's control token (written to <run_dir>/control.token)
        self.api_key: str | None = None  # what the engines' OpenAI API asks off loopback (rollout.api_key)
        self.pools: Pools | None = None
        self.trainer: TrainerGroup | None = None
        self.rollout: RolloutPool | None = None
        self.transport_epoch = 0
        self.engine_start_s: list[float] = []
        self._manifest = None  # the trainer's manifest (asked of it at the first sync)
        self.armed: ArmedReceive | None = None
        self._arm_ids = 0
        self._last_sync_s: float | None = None  # the last sync's announce -> serving (``sync_stats``)
        self._signals = None  # the driver's word to armed pushes and receives (transport.signals: signals.py)
        self.signals = cfg.transport.signals  # how the groups' words travel (set_signals: benchmarks)

    @classmethod
    def start(cls, cfg: Config, run_dir: Path, model_path: Path | str) -> "Job":
        job = cls(cfg, run_dir, model_path)
        try:
            job._start()
        except BaseException:
            job.shutdown()
            raise
        return job

    def _start(self) -> None:
        from disagg.control.auth import api_key, write_token
        from disagg.control.server import CoordinatorServer

        cfg = self.cfg
        device = resolve_device(cfg)
        self.backend = resolve_backend(cfg, device)
        # Ray first: its node processes are forked, and forking with live gRPC threads is unsafe.
        connect(cfg, device)
        self.token, token_path = write_token(self.run_dir)
        self.api_key = api_key(cfg.rollout.api_key, self.token)  # the engines' OpenAI API asks it off loopback
        c = cfg.control
        self.coordinator = CoordinatorServer(c.host, c.port, cfg.algorithm.max_staleness, str(self.run_dir),
                                             token=self.token, tls_cert=c.tls_cert, tls_key=c.tls_key,
                                             metrics_port=c.metrics_port).start()
        (self.run_dir / "coordinator.addr").write_text(self.coordinator.address + "\n")
        log.info("coordinator listening on %s (token in %s)", self.coordinator.address, token_path)
        self.pools = create_pools(cfg, device)
        self._register_pool("trainer", self.pools.trainer_pg, self.pools.trainer_bundle, cfg.trainer.num_workers,
                            cfg.trainer.num_workers)
        self.register_rollout_pool(cfg.rollout.num_engines)
        t0 = time.perf_counter()
        # The engines start while the trainer's workers load the model (on GPUs a large model's load
        # overlaps vLLM's profiling and cache set-up), except where they share a GPU: vLLM sizes its
        # KV cache from the memory free while it profiles, which a loading trainer would change.
        shared_gpu = device == "cuda" and shares_gpus(cfg)
        self.rollout = RolloutPool(cfg, self.pools.rollout_pg, device, str(self.model_path), self.control_client(),
                                   label_selector=self.pools.rollout_label_selector, wait=shared_gpu,
                                   api_key=self.api_key)
        self.trainer = TrainerGroup(cfg, self.pools.trainer_pg, device, str(self.model_path))
        self.rollout.wait_started()
        self.engine_start_s = [i["start_s"] for i in self.rollout.start_info]
        log.info("pools up in %.1fs (engine start %s s)", time.perf_counter() - t0,
                 ", ".join(f"{s:.1f}" for s in self.engine_start_s))
        self.init_transport()

    def register_rollout_pool(self, num_engines: int) -> None:
        """Tell the coordinator the rollout pool's size (at start and after every scale step)."""
        self._register_pool("rollout", self.pools.rollout_pg, self.pools.rollout_bundle,
                            num_engines * self.cfg.rollout.tensor_parallel_size, num_engines)

    def _register_pool(self, name: str, pg, bundle: dict[str, float], num_bundles: int, num_workers: int) -> None:
        from disagg.control.types import PoolStatus

        res = ",".join(f"{k}:{v:g}" for k, v in bundle.items())
        self.coordinator.state.register_pool(PoolStatus(name, num_bundles, res, pg.id.hex(), num_workers))

    def change_engines(self, members: list[tuple[int, object]]) -> None:
        """Make ``members`` ((engine id, handle), in rank order) the engines of the transport group:
        rebuilt with a new epoch (a member that does not join fails the rendezvous within
        ``transport.timeout_s``). Call only between syncs."""
        before = list(self.rollout.engine_ids)
        self.rollout.set_members(members)
        self.init_transport()
        self.register_rollout_pool(len(members))
        log.info("rollout engines %s -> %s (transport epoch %d)", before, self.rollout.engine_ids,
                 self.transport_epoch)

    def control_client(self):
        """A coordinator client for actors (pickled to them: address, token, TLS root; no channel)."""
        from disagg.control.client import CoordinatorClient

        c = self.cfg.control
        return CoordinatorClient(self.coordinator.address, timeout_s=c.rpc_timeout_s, token=self.token,
                                 tls_ca=(c.tls_ca or c.tls_cert) if c.tls_cert else None)

    def init_transport(self) -> None:
        """(Re)build the transport groups: one per sending trainer rank, each with every engine worker."""
        from disagg.transport.sync import source_groups_needed

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
            self.init_transport()

    def sync_weights(self, policy_version: int, trainer_step: int) -> SyncStats:
        """Announce ``policy_version`` and broadcast it to every engine; returns when all acked."""
        return self.finish_sync(self.start_sync(policy_version, trainer_step))

    def replan_buckets(self, first_bucket_bytes: int) -> int:
        """Benchmarks: the trainer's next pushes go out in buckets that ramp from ``first_bucket_bytes``
        (``TrainerPush.replan_buckets``; 0: none): a new layout, whose manifest the next announce
        carries. Not with a sync armed. The new layout's bucket count (trainer rank 0's)."""
        if self.armed is not None:
            raise TransportError(f"replan_buckets: a receive of version {self.armed.policy_version} is armed")
        counts = ray_get_logged([self.trainer.transport_method(w, "replan_buckets").remote(first_bucket_bytes)
                                 for w in range(len(self.trainer.workers))], what="re-planning the buckets",
                                timeout_s=self.cfg.transport.timeout_s, log=log)
        self._manifest = None
        return counts[0]

    def arm_sync(self, policy_version: int, timeout_s: float) -> None:
        """Put every engine's receive of ``policy_version`` on the transport group now, before the trainer
        has the version (while the engines would be idle: a sync loop's train step). The engine stops
        its steps while it waits (``timeout_s`` at most; the trainer dying ends it), and a call into vLLM's
        engine core (a version query, a generation) waits behind it until the sync. With
        ``transport.overlap_push`` the trainer's push is put in place too, on its transport thread,
        waiting in the group's store for the driver's word (the step's end packs its first buckets:
        ``EarlyPack``). ``start_sync`` of that version then only
        sets that word after the announce: no Ray, engine-core or trainer dispatch between the announce
        and the wire (without overlap_push it calls the trainer, whose push wakes the engines).
        ``disarm`` calls it off."""
        if self.armed is not None:
            raise TransportError(f"an armed receive (version {self.armed.policy_version}) is already waiting")
        if self._manifest is None:
            self._manifest = self.trainer.manifest(policy_version)
        self._arm_ids += 1
        # With the trainer's push armed too, its header goes out now and every worker takes it before
        # the word (a dense push's: WeightSender.send(header_first=True)); after the word, only buckets.
        refs = self.rollout.receive_weights_async(policy_version, digest=self._manifest.layout_digest(), ack=False,
                                                  arm_id=self._arm_ids, arm_timeout_s=timeout_s,
                                                  max_staleness=self.coordinator.state.max_staleness(),
                                                  arm_header=self._signals is not None)
        pushes = (self.trainer.push_weights_async(policy_version, False, self._arm_ids, go_timeout_s=timeout_s,
                                                  last_sync_s=self._take_last_sync_s())
                  if self._signals is not None else [])
        self.armed = ArmedReceive(self._arm_ids, policy_version, refs, tuple(self.rollout.engine_ids),
                                  self.transport_epoch, pushes)

    def disarm(self, timeout_s: float | None = None) -> None:
        """Call off the armed receive, if any: the trainer tells the engines, which return having loaded
        nothing. A party that cannot be told (dead, its group gone) is left to its own timeout."""
        armed, self.armed = self.armed, None
        if armed is None:
            return
        timeout_s = self.cfg.transport.timeout_s if timeout_s is None else timeout_s
        try:
            if armed.pushes:  # the trainer's armed push calls the engines' receives off itself
                from disagg.transport.sync import ARM_CANCEL

                self._go(armed, ARM_CANCEL)
            else:
                ray_get_logged(self.trainer.disarm_async(armed.arm_id), what=f"calling off armed receive "
                               f"{armed.arm_id}", timeout_s=timeout_s, log=log)
            ray_get_logged(armed.pushes + armed.refs, what=f"armed receive {armed.arm_id} to return",
                           timeout_s=timeout_s, log=log)
        except Exception as e:  # noqa: BLE001 - a dead party is the caller's to handle: the next sync finds it
            log.warning("armed receive of version %d not called off cleanly: %s", armed.policy_version,
                        str(e).splitlines()[0][:300])

    def _go(self, armed: ArmedReceive, word: str) -> None:
        """The driver's word (``ARM_SEND`` or ``ARM_CANCEL``) to every party of an armed sync at once,
        through each group's store: the trainer's armed pushes (``go_key``) and the engines' armed
        receives (``arm_key``), so that the engines wake beside the trainer rather than one store hop
        after it. A store that is gone means its trainer rank died: its push's ref says so."""
        from disagg.transport.sync import arm_key, go_key

        for failed in self._signals.signal({go_key(armed.arm_id): word, arm_key(armed.arm_id): word}):
            log.warning("armed push %d: could not say %r (%s)", armed.arm_id, word, failed)

    def start_sync(self, policy_version: int, trainer_step: int, from_snapshot: bool = False) -> "PendingSync":
        """Announce ``policy_version`` and start its broadcast; engines keep generating until they
        receive (each pauses its in-flight requests only while it loads). ``finish_sync`` waits.
        ``from_snapshot``: the trainer sends the copy its step took (``transport.overlap_push``).

        One message per party: the coordinator lives in this process, so the version is announced
        to it directly, with the trainer's manifest (asked of it once: its layout never changes);
        each engine is told the layout's digest, and fetches the manifest only when it does not
        hold that layout yet; the engines' acks come back with their reports (``finish_sync``). Where
        the engines' receives of this version are armed (``arm_sync``), only the trainer is called."""
        armed = self.armed
        if armed is not None and ((armed.policy_version, armed.engine_ids, armed.epoch) != (
                policy_version, tuple(self.rollout.engine_ids), self.transport_epoch)
                or (armed.pushes and from_snapshot) or _any_done(armed.refs + armed.pushes)):
            # armed for another version, other engines or the live weights, or a party ended (failed) meanwhile
            # (checked before the announce: whether the arming holds is no part of this version's sync)
            self.disarm()
            armed = None
        t0, wall0 = time.perf_counter(), time.time()
        if self._manifest is None:
            self._manifest = self.trainer.manifest(policy_version)
        manifest = self._manifest.with_version(policy_version)
        try:
            self.coordinator.state.announce_version(manifest, trainer_step)  # may refuse it: before any byte moves
        except BaseException:
            self.disarm()
            raise
        self.armed = None
        if armed is not None and armed.pushes:  # every party waits on the group: the driver's word starts it
            from disagg.transport.sync import ARM_SEND

            self._go(armed, ARM_SEND)
            pushes, receives = armed.pushes, armed.refs
        elif armed is not None:  # the engines wait on the group: the trainer's push wakes them
            pushes = self.trainer.push_weights_async(policy_version, from_snapshot, armed.arm_id,
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

    def finish_sync(self, pending: "PendingSync") -> SyncStats:
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
        stats = self.sync_stats(pending, outs[:n], outs[n:])
        # transport.delta=auto: the next push tells its chooser what this one cost end to end (the
        # last engine serving, by the parties' clocks), the receivers' work included
        self._last_sync_s = stats.timeline.get("worker_out") or stats.seconds
        return stats

    def _take_last_sync_s(self) -> float | None:
        """The last finished sync's announce -> serving, once (a push after a failed sync gets none)."""
        last, self._last_sync_s = self._last_sync_s, None
        return last

    def sync_stats(self, pending: "PendingSync", sent: list[dict], received: list = ()) -> SyncStats:
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

    @property
    def checkpoint_dir(self) -> str:
        """``trainer.checkpoint_dir`` (a shared path or an fsspec URL), else ``<run_dir>/checkpoints``."""
        from disagg.resume import default_checkpoint_dir

        return self.cfg.trainer.checkpoint_dir or default_checkpoint_dir(self.run_dir)

    def save_checkpoint(self, step: int, policy_version: int, extra: dict | None = None) -> str:
        """``<checkpoint_dir>/step_<N>``: the model in HF layout (safetensors; vLLM and HF load it),
        tokenizer, optimizer/scheduler/RNG state, ``state.json`` (step, version, ``extra``), and
        ``manifest.json``: every file's size and digest (``disagg.digests``), written last.

        Complete once the manifest is there. At a plain path (one filesystem for every node) the
        trainer ranks write ``step_<N>.partial`` and the driver renames it; at a URL every writer
        copies its files up and the driver writes ``state.json``, then the manifest (object stores
        cannot rename a directory atomically). A reader checks the files against the manifest."""
        import json

        from disagg import storage
        from disagg.digests import MANIFEST, digest_bytes, digest_files, manifest_text
        from disagg.resume import STATE, checkpoint_path

        path = checkpoint_path(self.checkpoint_dir, step)
        tmp = path if storage.is_url(path) else path + ".partial"
        storage.remove(tmp)
        t0 = time.perf_counter()
        files = self.trainer.save_checkpoint(tmp)
        # tokenizer files: the checkpoint is a complete model directory
        model_dir = storage.local_copy(str(self.model_path), self.cfg.model.cache_dir)
        tokenizer = [f.name for f in model_dir.iterdir() if f.is_file() and
                     f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template"))]
        files.update(digest_files(model_dir, tokenizer))
        for name in tokenizer:
            storage.put_file(model_dir / name, storage.join(tmp, name))
        state = json.dumps({"step": step, "policy_version": policy_version, "time_unix_s": time.time(),
                            "manifest": MANIFEST, **(extra or {})}, indent=2, default=str)
        files[STATE] = digest_bytes(state.encode())
        if tmp != path:
            storage.remove(path)
        storage.write_text(storage.join(tmp, STATE), state)
        storage.write_text(storage.join(tmp, MANIFEST), manifest_text(files))
        if tmp != path:
            Path(tmp).rename(path)  # a checkpoint directory without .partial is complete
        log.info("checkpoint of step %d (policy version %d) written to %s in %.1fs: %d files, %.1f MB, with their "
                 "digests", step, policy_version, path, time.perf_counter() - t0, len(files),
                 sum(f.num_bytes for f in files.values()) / 1e6)
        return path

    def shutdown(self) -> None:
        if self.armed is not None and self.trainer is not None:
            self.disarm(timeout_s=10.0)  # the engines' workers return before their actors are stopped
        if self._signals is not None:
            self._signals.close()
            self._signals = None
        if self.rollout is not None:
            self.rollout.shutdown()
        if self.trainer is not None:
            self.trainer.shutdown()
        if self.pools is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pools.trainer_pg)
            remove_placement_group(self.pools.rollout_pg)
        if self.coordinator is not None:
            self.coordinator.stop()
