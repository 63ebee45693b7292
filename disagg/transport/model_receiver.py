"""The receiving end of weight syncs inside an inference engine's model process, whichever engine
hosts it: one receiver, not one per engine (issue 59).

An engine enters it through its own hook - vLLM's weight-transfer backend
(``disagg.rollout.vllm.transfer``), SGLang's scheduler plugin - and hands it plain things: the live
model (an ``nn.Module`` with ``load_weights(iterable of (name, tensor))``), its device, this worker's
place among the engine's workers, whether loads into the live parameters reach what its kernels
read, and its layerwise reload (``LayerwiseReload``) where it has one. Everything else is here:
joining the transport groups (one per sending trainer rank), each group's delta image
(``transport.delta``), the manifest kept by layout digest, an armed receive's wait for its word, the
receive itself (``model_transfer.receive_model``) and the figures of each update (``last_stats``).

Loads go one of two ways (``transport.load``):

- ``layerwise``: the engine's layerwise reload (vLLM's own NCCL backend uses it). Each layer's
  parameters are put back on the meta device at the start, the received tensors are held until a
  layer is complete, then the layer is materialised afresh, loaded, post-processed (CPU linear
  layers repack their weights, quantised layers re-quantise) and copied into the storage the kernels
  and CUDA graphs point at. Needed on CPU and for quantised models.
- ``direct``: into the live parameters (the model's loader fuses qkv / gate_up and shards for TP,
  copying in place). No second copy of the weights and no per-layer materialisation; only where the
  loaded tensors are the ones the kernels read. ``auto`` picks it there. The first sync of a layout
  calls ``model.load_weights`` and learns from it where each received tensor lands
  (``disagg.transport.copyplan``); later syncs replay that as one fused copy per bucket, straight
  from the receive buffer, while the next bucket is on the wire (a tensor split over buckets part by
  part as its buckets arrive, never assembled).

This module must never import an inference engine (vLLM, SGLang) or Ray: an engine's own package
adapts it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from disagg.errors import ChecksumError, DeltaRefused, SyncCancelled
from disagg.transport.buckets import PartLoader, bucket_checksum
from disagg.transport.copyplan import BucketReplay, CopyPlan, Recorded, learn
from disagg.transport.delta import DeltaImage
from disagg.transport.group import TransportGroup, create_group, timed_raw_broadcasts
from disagg.transport.manifest import BucketPlan, Manifest, ManifestCache
from disagg.transport.model_transfer import Arm, receive_model

# A rollout worker's lines, whichever engine hosts the receiver.
log = logging.getLogger("disagg.rollout.transfer")

LOAD_MODES = ("auto", "layerwise", "direct")


@dataclass
class DisaggInitInfo:
    """What a worker needs to join the transport groups (the engine actor's ``init_transport``)."""

    groups: list  # [host, port, group name] per source group (one per sending trainer rank)
    world_size: int
    rank_offset: int  # the group rank of the engine's first worker
    backend: str
    timeout_s: float
    source: str = "gather"
    num_buffers: int = 2
    verify: bool = False
    load: str = "auto"  # transport.load: auto | layerwise | direct
    delta: bool = False  # transport.delta on or auto: receive with receive_delta onto an image per group
    high_priority: bool = False  # transport.nccl_high_priority: the group's stream at the highest CUDA priority
    signals: str = "store"  # transport.signals: the group's words through its store or to doorbells (sockets)


@dataclass
class DisaggUpdateInfo:
    """One update as the engine actor asks a worker for it (``EngineSync.receive_weights``)."""

    manifest: dict | None = None  # the whole manifest; None: the one this worker holds, at ``policy_version``
    digest: str = ""  # the layout digest of the manifest meant (checked against the one held)
    policy_version: int = 0
    arm: dict | None = None  # an armed receive (``Arm.as_dict``: waits for its word first); None: not armed


@dataclass(frozen=True)
class LayerwiseReload:
    """An engine's layerwise reload of its model (vLLM's): ``begin`` before an update's first tensors
    are loaded through ``load_weights``, ``end`` after its last (the layers still waiting processed)."""

    begin: Callable[[], None]
    end: Callable[[], None]


def resolve_load_mode(requested: str, why_not_direct: str | None, reloads: bool, engine: str = "the engine") -> str:
    """``transport.load`` for one worker (pure): 'layerwise' or 'direct'. ``why_not_direct``: the model
    as an error names it where loads into its live parameters would not reach what its kernels read
    (None: they would); ``reloads``: whether ``engine`` has a layerwise reload."""
    if requested not in LOAD_MODES:
        raise ValueError(f"transport.load must be auto, layerwise or direct, got {requested!r}")
    if requested == "direct" and why_not_direct is not None:
        instead = "use 'layerwise' or 'auto'" if reloads else f"{engine} has no layerwise reload to load it with"
        raise ValueError(f"transport.load='direct' cannot load into {why_not_direct}: {instead}")
    mode = requested if requested != "auto" else "direct" if why_not_direct is None else "layerwise"
    if mode == "layerwise" and not reloads:
        picked = "" if requested == "layerwise" else f" (what 'auto' picks for {why_not_direct})"
        instead = "use 'direct'" if why_not_direct is None else "no other mode loads it"
        raise ValueError(f"transport.load={requested!r} needs a layerwise reload{picked}, which {engine} "
                         f"does not have: {instead}")
    return mode


class ModelReceiver:
    """Receives disagg's bucketed broadcasts into one engine worker's model.

    An update is ``start``, ``receive``, ``finish`` (``sync`` makes all three). The layerwise reload
    starts lazily, right before the first tensors are loaded: with ``verify`` that is after every
    bucket's checksum matched, so a rejected version never touches the model and the engine keeps
    serving the previous one.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, *, engine: str, quantized: bool = False,
                 repacks: bool = False, reload: LayerwiseReload | None = None) -> None:
        """``engine``: its name in messages ("vLLM"); ``quantized``: the model's weights are quantised
        after loading; ``repacks``: the engine's linear layers repack loaded weights (vLLM's on CPU).
        Either way only a layerwise ``reload`` loads the model."""
        self.model, self.device, self.engine, self.reload = model, device, engine, reload
        self._why_not_direct = ("a quantised model" if quantized else
                                f"a {device.type} worker (its linear layers repack their weights)" if repacks else None)
        self.groups: list[TransportGroup] = []
        self.images: list[DeltaImage] | None = None  # transport.delta: per group, the version this worker holds
        self.info: DisaggInitInfo | None = None
        self.last_stats: dict[str, Any] = {}
        self.load_mode = "layerwise"
        self._reloading = False
        self._times: dict[str, float] = {}
        self._manifest_cache = ManifestCache()  # the last layout received (the update info may omit it)
        # direct loads: (layout digest, where the parameters live) -> the copy plan its first sync
        # learned (None: the loader cannot be replayed); the copies learned so far in the sync that
        # is learning one. A reload that moves parameters makes another key: the plan is learned again.
        self._plans: dict[tuple, CopyPlan | None] = {}
        self._learning: Recorded | None = None
        self._plan_key: tuple | None = None
        self._plan_note = ""

    def join(self, info: DisaggInitInfo, worker_index: int) -> None:
        """Join ``info``'s transport groups, leaving any held, as rank ``info.rank_offset + worker_index``
        (``worker_index``: this worker's place among its engine's workers)."""
        rank = info.rank_offset + worker_index
        self.shutdown()
        self.info = info
        self.set_load_mode(info.load)
        self.groups = [
            create_group(host=host, port=int(port), rank=rank, world_size=info.world_size, backend=info.backend,
                         timeout_s=info.timeout_s, group_name=name, device=self.device,
                         high_priority=info.high_priority, signals=info.signals)
            for host, port, name in info.groups
        ]
        # New groups: this worker holds nothing of the trainer's yet, and the first sync is dense.
        self.images = [DeltaImage(self.device) for _ in self.groups] if info.delta else None
        log.info("[rollout] joined %d transport group(s) as rank %d/%d (load %s%s)", len(self.groups), rank,
                 info.world_size, self.load_mode, ", delta syncs" if info.delta else "")

    def set_load_mode(self, requested: str) -> str:
        """Load the next updates as ``requested`` (``transport.load``) resolves for this worker; the mode."""
        self.load_mode = resolve_load_mode(requested, self._why_not_direct, self.reload is not None, self.engine)
        return self.load_mode

    def sync(self, info: DisaggUpdateInfo) -> dict[str, Any]:
        """One whole update in one call (``start``, ``receive``, ``finish``); the receive's figures."""
        entered = time.time()
        self.start()
        self.receive(info)
        self.finish()
        return dict(self.last_stats, worker_in_unix_s=entered, worker_out_unix_s=time.time())

    def start(self) -> None:
        """Begin an update (its timings from zero)."""
        self._reloading = False
        self._times = {"load_s": 0.0, "reload_init_s": 0.0, "finalize_s": 0.0}

    def receive(self, info: DisaggUpdateInfo) -> None:
        """Receive and load one version; its figures in ``last_stats``. An armed receive the sender called
        off returns with ``cancelled`` there and the model untouched; a version whose checksums failed or
        whose delta this worker cannot apply raises with ``rejected`` there and nothing loaded."""
        if not self.groups or self.info is None:
            raise RuntimeError(f"disagg weight transfer: {self.engine}'s worker never joined the transport groups "
                               "(ModelReceiver.join; vLLM: init_weight_transfer_engine)")
        manifest = self._manifest_for(info)
        self.last_stats = {"policy_version": manifest.policy_version, "rejected": None, "load_mode": self.load_mode,
                           "signals": self.groups[0].signals}  # how this worker's groups take their words
        parts = self._plan_for(manifest)
        arm = Arm.from_dict(info.arm) if info.arm is not None else None
        try:
            # A delta loads every tensor where a layerwise reload needs whole layers, and where a copy
            # plan is being learned (it must see every tensor); direct loads replay only what changed.
            stats = receive_model(self.groups, manifest, self._load, device=self.device, source=self.info.source,
                                  num_buffers=self.info.num_buffers, verify=self.info.verify, arm=arm,
                                  images=self.images,
                                  load_unchanged=self.load_mode != "direct" or self._learning is not None,
                                  parts=parts)
        except SyncCancelled as e:  # before any byte moved: the model is untouched
            self._learning = None
            self.last_stats["cancelled"] = str(e)
            return
        except (ChecksumError, DeltaRefused) as e:  # the group is in step; nothing was loaded
            self.last_stats["rejected"] = str(e)
            self._learning = None
            raise
        except BaseException:
            self._learning = None
            self._mend_reload()
            raise
        self._keep_learned()
        if arm is not None:  # the wait for the word came before the announce: not part of the sync's time
            self._times.update(armed_wait_s=stats.go_wait_s, armed_go_unix_s=stats.go_unix_s)
        self.last_stats.update(bytes=stats.bytes, seconds=stats.seconds, num_buckets=stats.num_buckets,
                               num_tensors=stats.num_tensors, copy_plan=self._plan_note,
                               wire_start_unix_s=stats.header_unix_s, wire_end_unix_s=stats.wire_end_unix_s,
                               worker_posted_unix_s=stats.posted_unix_s,
                               loaded_unix_s=stats.loaded_unix_s, **self._times)

    def finish(self) -> None:
        """End an update: the layerwise reload, if one began, processes the layers still waiting."""
        if not self._reloading:
            return
        t0 = time.perf_counter()
        self.reload.end()
        self._reloading = False
        self._times["finalize_s"] = time.perf_counter() - t0
        self.last_stats["finalize_s"] = self._times["finalize_s"]

    def param_checksums(self) -> dict[str, list[int]]:
        """Each parameter's bit checksum (``bucket_checksum``): the test that a sync left every parameter
        equal to the trainer's, bit for bit, without moving the weights anywhere."""
        return {name: bucket_checksum(p.detach().reshape(-1)).tolist() for name, p in self.model.named_parameters()}

    def raw_receive(self, nbytes: int, repeats: int) -> list[float]:
        """Take part in ``repeats`` raw broadcasts of ``nbytes`` from the trainer on this worker's first
        transport group (the baseline of a sync's rate); each one's seconds."""
        if not self.groups:
            raise RuntimeError("raw receive: the worker has not joined a transport group")
        return timed_raw_broadcasts(self.groups[0], nbytes, repeats, self.device)

    def shutdown(self) -> None:
        """Leave the transport groups."""
        for g in self.groups:
            g.destroy()
        self.groups = []

    def _manifest_for(self, info: DisaggUpdateInfo) -> Manifest:
        """The update's manifest if it carries one, else the one held when its layout digest is the
        update's (``ManifestCache``); an update naming another layout is refused."""
        if info.manifest is not None:
            return self._manifest_cache.hold(Manifest.from_dict(info.manifest))
        held = self._manifest_cache.by_digest(info.digest, info.policy_version)
        if held is None:
            raise RuntimeError(f"disagg weight transfer: update without a manifest for layout {info.digest!r}, "
                               f"this worker holds {self._manifest_cache.digest!r}")
        return held

    def _plan_for(self, manifest: Manifest) -> PartLoader | None:
        """Direct loads: learn this layout's copy plan, or replay it; where it is replayed a part or a
        bucket at a time, the ``PartLoader`` that does so. Sets ``copy_plan``'s note."""
        self._plan_key, self._learning, self._plan_note = None, None, ""
        if self.load_mode != "direct":
            return None
        # where every parameter's memory lives now (a few hundred pointers: microseconds)
        where = tuple(p.untyped_storage().data_ptr() for p in self.model.parameters())
        self._plan_key = (manifest.layout_digest(), where)
        if len(self._plans) > 4 and self._plan_key not in self._plans:
            self._plans.clear()
        if self._plan_key not in self._plans:
            self._learning, self._plan_note = Recorded({}, {}), "learned"
            return None
        plan = self._plans[self._plan_key]
        self._plan_note = "loader" if plan is None else "replayed"
        if plan is None or self.info.verify or self.images is not None:
            return None
        # A replayed plan copies each part of a tensor split over buckets as it arrives: no tensor
        # of up to a gigabyte (a 7B vocabulary) assembled on the engine's GPU first, and one copy less.
        # Where the plan covers the whole layout (one group's dense receive), each bucket is loaded at
        # once: one fused copy.
        replay = plan.bucket_replay(manifest) if self.info.source == "gather" else None
        if replay is not None:
            self._plan_note = "replayed by bucket"
        return PartLoader(plan.part_names, self._load_part,
                          bucket=None if replay is None else functools.partial(self._load_bucket, replay))

    def _mend_reload(self) -> None:
        """After a broken receive: a layerwise reload left half done (some layers on the meta device) is
        finished, so the model is whole again - part old, part new weights, never served (the engine's
        gate stays closed) - and the next sync can reload it."""
        if not self._reloading:
            return
        try:
            self.finish()
        except Exception as e:  # noqa: BLE001 - the receive's own error is the one raised
            log.error("[rollout] could not finish the interrupted weight reload: %s", e)

    def _keep_learned(self) -> None:
        """The whole version went through the model's loader, each copy recorded: keep the plan."""
        if self._learning is None:
            return
        self._plans[self._plan_key] = CopyPlan(self._learning)
        self._learning = None
        log.info("[rollout] direct loads replay %d copies learned from %s's load_weights",
                 self._plans[self._plan_key].num_copies, self.engine)

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        if self.load_mode == "direct":
            # Copies into the live parameters are made before this returns (on the stream, before
            # the next receive into this buffer): views of the receive buffer need no copy of their own.
            self._load_direct(tensors)
        else:
            if not self._reloading:
                self.reload.begin()
                self._reloading = True
                t1 = time.perf_counter()
                self._times["reload_init_s"] += t1 - t0
                t0 = t1
            # A layerwise reload holds the tensors it is given until their layer is complete, which
            # may be after the receive buffer they view was reused for a later bucket: hand it
            # copies of views.
            self.model.load_weights([(n, t.clone() if t._base is not None else t) for n, t in tensors])
        self._times["load_s"] = self._times.get("load_s", 0.0) + time.perf_counter() - t0

    def _load_direct(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Replay the layout's copy plan; without one, the model's ``load_weights``, learning the plan."""
        key = self._plan_key
        plan = self._plans.get(key)
        if plan is not None:
            plan.apply(tensors)
        elif key in self._plans or self._learning is None:  # the loader cannot be replayed
            self.model.load_weights(tensors)
        else:
            recorded, why = learn(self.model.load_weights, tensors, [*self.model.parameters(), *self.model.buffers()])
            if why is None:
                self._learning.update(recorded)
            else:
                log.warning("[rollout] direct loads stay with %s's load_weights, whose work is more than "
                            "copies to replay: %s", self.engine, why)
                self._learning, self._plans[key], self._plan_note = None, None, "loader"

    def _load_part(self, name: str, part: torch.Tensor, offset: int, last: bool) -> None:
        """A part of a tensor split over buckets, copied where the replayed plan puts it (direct)."""
        t0 = time.perf_counter()
        self._plans[self._plan_key].apply_part(name, part, offset, last)
        self._times["load_s"] = self._times.get("load_s", 0.0) + time.perf_counter() - t0
        self._times["num_parts"] = self._times.get("num_parts", 0) + 1

    def _load_bucket(self, replay: BucketReplay, bucket: BucketPlan, buf: torch.Tensor) -> int:
        """A whole received bucket copied where the replayed plan puts its bytes (direct)."""
        t0 = time.perf_counter()
        completed = replay.load(bucket, buf)
        self._times["load_s"] = self._times.get("load_s", 0.0) + time.perf_counter() - t0
        self._times["whole_buckets"] = self._times.get("whole_buckets", 0) + 1
        return completed
