"""The trainer worker's side of the weight sync, one version at a time and top-down: its transport
group (rank 0 of it, hosting the group's store), the manifest it sends (planned once), the
snapshots a train step takes for an overlapped push, and the push itself (``push_weights``:
armed or dispatched, from the live parameters or a snapshot). A part of ``TrainerWorker``, which
holds the model, the device and the transport config it reads."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch

from disagg.logs import traced

if TYPE_CHECKING:
    from disagg.transport.model_transfer import Arm


def allocated_bytes(device: torch.device) -> tuple[int, int]:
    """(bytes allocated on the CUDA ``device`` now, the peak since the last reset), read from the
    allocator's nested statistics: ``torch.cuda.memory_allocated`` first flattens and sorts every
    statistic into a new dict (~0.1 ms of Python), and the push reads these on a sync's critical path."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]
    return int(stats["current"]), int(stats["peak"])


class TrainerPush:
    """``TrainerWorker``'s weight push (its transport group, manifests, snapshots, pushes)."""

    def init_transport(self, *, host: str, port: int, world_size: int, backend: str, timeout_s: float,
                       group_name: str, signals: str = "store") -> None:
        """Join this rank's source group as its rank 0 (hosting its TCPStore); ``signals``: how its words
        travel (``transport.signals``, as the driver says: every member of a group alike)."""
        from disagg.transport.delta import DeltaChooser, DeltaImage
        from disagg.transport.group import create_group
        from disagg.transport.sender import WeightSender

        if self.group is not None:
            self.group.destroy()
        self.group = create_group(host=host, port=port, rank=0, world_size=world_size, backend=backend,
                                  timeout_s=timeout_s, group_name=group_name, device=self.device,
                                  high_priority=self.transport_cfg.nccl_high_priority, signals=signals)
        # Packed where the parameters live: over gloo from a GPU the buckets leave it whole.
        self.sender = WeightSender(self.group, 0, self.transport_cfg.num_buffers, self.transport_cfg.verify,
                                   device=self.device)
        # A new group's engines hold nothing of ours: its first sync is dense.
        self.delta_image = DeltaImage(self.device) if self.transport_cfg.delta != "off" else None
        self.delta_chooser = DeltaChooser() if self.transport_cfg.delta == "auto" else None

    def manifest(self, policy_version: int) -> dict:
        """The full-tensor manifest of this model at ``policy_version`` (layout only; no collective)."""
        return self._layout(policy_version).to_dict()

    def _layout(self, policy_version: int = 0):
        """The full-tensor manifest at ``policy_version``, planned at the first call (its layout changes
        only when a benchmark re-plans it: ``disagg.bench.actors``)."""
        from disagg.transport.model_transfer import model_manifest

        cfg = self.transport_cfg
        return self._manifest_cache.made_at(policy_version, lambda: model_manifest(
            self.model, cfg.bucket_bytes, 0, cfg.dtype, cfg.first_bucket_bytes))

    def _take_snapshot(self, policy_version: int):
        """The parameters copied as ``policy_version``, laid out as this rank's push sends them."""
        return self._snapshots.take(policy_version, self._local_params(), self._flats, self._push_layout().buckets)

    def _push_layout(self):
        """The manifest this rank's pushes send (its shards' under source=shards): a snapshot is laid
        out as its buckets, so that the push sends views of it."""
        from disagg.transport.model_transfer import source_manifests

        if self._push_manifest_cache.held is None:
            full = self._layout()
            self._push_manifest_cache.hold(source_manifests(full, self.world_size)[self.rank]
                                           if self.transport_cfg.source == "shards" else full)
        return self._push_manifest_cache.held

    def announce(self, coordinator, policy_version: int, trainer_step: int, timeout_s: float) -> str:
        """Tell the coordinator (gRPC) that ``policy_version`` exists, with its manifest; returns its digest.
        ``coordinator``: a CoordinatorClient (address, token, TLS root) or "host:port"."""
        from disagg.control.client import CoordinatorClient
        from disagg.transport.manifest import Manifest

        if self._coord is None or self._coord.address != getattr(coordinator, "address", coordinator):
            self._coord = (coordinator if isinstance(coordinator, CoordinatorClient)
                           else CoordinatorClient(coordinator, timeout_s=timeout_s))
        m = Manifest.from_dict(self.manifest(policy_version))
        self._coord.announce_version(m, trainer_step)
        return m.layout_digest()

    def push_weights(self, policy_version: int, from_snapshot: bool = False, arm: Arm | None = None,
                     last_sync_s: float | None = None) -> dict[str, Any]:
        """``_push``, under the profiler when a benchmark asked (``_trace_path``; its timings then carry
        the profiler's cost). ``last_sync_s``: the sync before, announce -> serving, as the driver saw
        it; ``transport.delta=auto`` weighs that sync's kind by it (the receivers' work included)."""
        if self.delta_chooser is not None and last_sync_s:
            self.delta_chooser.amend(last_sync_s)
        path, self._trace_path = self._trace_path, None
        return traced(path, self.device.type == "cuda",
                      lambda: self._push(policy_version, from_snapshot, arm))

    def _push(self, policy_version: int, from_snapshot: bool = False, arm: Arm | None = None) -> dict[str, Any]:
        """Send the current parameters as ``policy_version``; every rank must call this
        (gather mode: the full-tensor gathers are collectives over the trainer ranks).
        ``arm`` (``WeightSync.arm``): the engines wait on the group in an armed receive; without
        ``arm.push_waits`` this wakes them first (``ARM_SEND`` on ``arm_key(arm.id)``).

        ``from_snapshot``: send the copy the train step that made ``policy_version`` took
        instead; this runs on the actor's ``transport`` thread while the next step trains
        (not with ``source=gather`` over several ranks, whose gathers are collectives).

        ``arm.push_waits``: an armed push, called while the step that makes the version still trains:
        it sets up (its buckets planned, its header on the device and, dense, on the wire), then waits
        in the group's store for the driver's word (``go_key(arm.id)``), at most ``arm.timeout_s``,
        and sends the moment it comes, with no Ray call between the announce and the wire. Called off
        instead, it calls off the engines' receives too and returns ``cancelled``; its wait is
        ``go_wait_s``, not part of the push.
        """
        from disagg.errors import SyncCancelled
        from disagg.transport.sender import EarlyPack
        from disagg.transport.model_transfer import ARM_SEND, arm_key, send_model

        m = self._layout(policy_version)
        if not from_snapshot and self._params is None:  # parameters are updated in place from here on
            self._params = dict(self.model.named_parameters())
        out: dict[str, Any] = {"rank": self.rank}
        clock = {"t0": time.perf_counter(), "wall0": time.time()}
        memory: dict[str, int] = {}
        go = (self._armed_go(policy_version, arm, out, clock)
              if arm is not None and arm.push_waits and self.group is not None else None)
        image = self.delta_image
        if image is not None and image.version is not None and policy_version <= image.version:
            image.invalidate()  # sent again after a failure: an engine may hold something else, so dense
        forced, dense, estimate = self._push_kind()
        # An armed push from the live parameters: the train step that ends meanwhile packs its first
        # buckets (TrainerWorker.train_step -> EarlyPack.params_final) before the driver's word.
        early = EarlyPack() if go is not None and not from_snapshot else None

        def send(tensors: dict[str, torch.Tensor]):
            return send_model(self.group, self.model, m, source=self.transport_cfg.source, trainer_rank=self.rank,
                              num_trainer_ranks=self.world_size, num_buffers=self.transport_cfg.num_buffers,
                              verify=self.transport_cfg.verify, sender=self.sender, params=tensors, image=image,
                              dense=dense, estimate=estimate, go=go, early=early)

        if arm is not None and not arm.push_waits and self.group is not None:
            # (an armed push's go woke the engines too: WeightSync._go sets both words)
            self.group.signal(arm_key(arm.id), ARM_SEND)  # the header follows at once
        self._early = early
        try:
            if from_snapshot:
                stats = self._send_snapshot(policy_version, send)
                out["snapshot"] = True
            else:
                if go is None and self.device.type == "cuda":  # what the push allocates beyond this, at its peak
                    torch.cuda.reset_peak_memory_stats(self.device)
                    memory["base"] = allocated_bytes(self.device)[0]
                stats = send(self._params)
                if "base" in memory:
                    out["peak_extra_bytes"] = allocated_bytes(self.device)[1] - memory["base"]
        except SyncCancelled as e:  # the driver's word was to call it off: the engines' receives too
            self._next_kind = forced
            self.disarm(arm)
            return {**out, "cancelled": str(e), "bytes": 0, "num_buckets": 0, "seconds": 0.0}
        finally:
            if self._early is early:
                self._early = None
            self._go_waiting.clear()
        out.update(seconds=time.perf_counter() - clock["t0"], bytes=0, num_buckets=0)
        self._report_push(out, stats)
        out.update(trainer_in_unix_s=clock["wall0"], trainer_out_unix_s=time.time())
        self._timeline.append(("push", policy_version, clock["wall0"], out["trainer_out_unix_s"]))
        return out

    def _armed_go(self, policy_version: int, arm: Arm, out: dict[str, Any], clock: dict[str, float]):
        """An armed push's wait for the driver's word, called by the send once it is set up (its
        buckets planned, its header on the device): the wire starts right after it. Called off:
        nothing is sent (``SyncCancelled``). Its wait goes into ``out["go_wait_s"]``, and the push's
        clock restarts at the word."""
        from disagg.errors import SyncCancelled
        from disagg.transport.model_transfer import ARM_SEND, go_key

        def go() -> None:
            self._go_waiting.set()  # (set up: params_final(wait_s) may go on)
            t_wait = time.perf_counter()
            try:
                said = self.group.await_signal(go_key(arm.id), arm.timeout_s, f"the driver's go for version "
                                               f"{policy_version}")
            except BaseException:
                with contextlib.suppress(Exception):  # the engines need not wait out their own timeouts
                    self.disarm(arm)
                raise
            out["go_wait_s"] = time.perf_counter() - t_wait
            if said != ARM_SEND:
                raise SyncCancelled(said)
            clock.update(t0=time.perf_counter(), wall0=time.time())
            # No allocator statistics read here (``peak_extra_bytes`` is a push's that is not armed):
            # they cost ~0.2 ms between the word and the header, and the step that trained
            # meanwhile would count in the peak.

        return go

    def _push_kind(self) -> tuple[str | None, bool, bool]:
        """(a benchmark's forced kind, or None; dense; estimate): a benchmark's choice (``_next_kind``),
        else ``transport.delta``'s chooser's (``estimate``: a dense sync that times one bucket's
        encoding as a delta); without a chooser, what the sender's image allows."""
        forced, self._next_kind = self._next_kind, None
        if forced is not None:
            return forced, forced == "dense", False
        chooser = self.delta_chooser
        dense = chooser is not None and not chooser.delta_next()
        return None, dense, dense and chooser.estimating

    def _report_push(self, out: dict[str, Any], stats) -> None:
        """A finished push's figures into ``out``, and its cost to ``transport.delta=auto``'s chooser."""
        if stats is None:
            return
        if self.delta_chooser is not None:
            self.delta_chooser.record(stats.delta_base != 0, stats.seconds, stats.bytes / max(1, stats.dense_bytes),
                                      estimate=stats.estimate)
        out.update(bytes=stats.dense_bytes, wire_bytes=stats.bytes, send_s=stats.seconds,
                   num_buckets=stats.num_buckets, group_bytes_sent=self.group.bytes_sent,
                   early_buckets=stats.early_buckets,
                   trainer_header_unix_s=stats.header_unix_s, delta_base=stats.delta_base,
                   changed_fraction=stats.changed_fraction,
                   **{f"trainer_{k}_unix_s": v for k, v in stats.stamps.items()})

    def params_final(self, wait_s: float = 0.0) -> bool:
        """The parameters hold the next version now: what the end of a train step does for an armed
        push (its first buckets packed, ``EarlyPack``); whether a push took it. ``wait_s``: for
        benchmarks that train no step, first wait (that long at most) until the armed push is set up
        and waits for the driver's word."""
        if wait_s > 0:
            self._go_waiting.wait(wait_s)
        early = self._early
        return early.params_final() if early is not None else False

    def take_snapshot(self, policy_version: int) -> dict[str, float]:
        """Copy the parameters as ``policy_version`` for a push from the snapshot, as a train step with
        ``snapshot_version`` ends (benchmarks: a push of staleness >= 1 without the step)."""
        t0 = time.perf_counter()
        snap = self._take_snapshot(policy_version)
        if snap.event is not None:
            snap.event.synchronize()
        return {"seconds": time.perf_counter() - t0, "bytes": snap.nbytes}

    def disarm(self, arm: Arm) -> None:
        """Call off the engines' armed receive ``arm`` (``ARM_CANCEL`` on ``arm_key(arm.id)``): they
        return without receiving anything."""
        from disagg.transport.model_transfer import ARM_CANCEL, arm_key

        if self.group is not None:
            self.group.signal(arm_key(arm.id), ARM_CANCEL)

    def _send_snapshot(self, policy_version: int, send):
        """``send`` the snapshot of ``policy_version``, holding it so no train step refills it meanwhile
        (CUDA: on the push stream, after the copy)."""
        from disagg.errors import TransportError

        if self.transport_cfg.source == "gather" and self.world_size > 1:
            raise ValueError("push_weights(from_snapshot=True) needs transport.source=shards or one trainer worker "
                             f"(source={self.transport_cfg.source!r}, {self.world_size} workers)")
        snap = self._snapshots.get(policy_version)
        with snap.lock:
            if snap.version != policy_version:  # refilled between the lookup and the lock
                raise TransportError(f"the snapshot of policy version {policy_version} was replaced by "
                                     f"{snap.version} before its push")
            if snap.event is None:
                return send(snap.tensors)
            if self._push_stream is None:
                self._push_stream = torch.cuda.Stream(self.device)
            self._push_stream.wait_event(snap.event)  # the copy is done before any byte leaves
            with torch.cuda.stream(self._push_stream):
                return send(snap.tensors)
