"""disagg's weight-transfer backend for vLLM, registered as ``"disagg"``.

vLLM creates this engine inside the process that holds the model (worker or
EngineCore) when started with ``weight_transfer_config={"backend": "disagg"}``;
the ``vllm.general_plugins`` entry point in pyproject.toml registers it in
every vLLM process (``plugin.register``). Receiving goes through ``disagg.transport.receiver`` - the
same unpacking as every other receiver - and loads in one of two ways
(``transport.load``):

- ``layerwise``: vLLM's layerwise reload (what vLLM's own NCCL backend does). Each
  layer's parameters are put back on the meta device at the start, the received
  tensors are held until a layer is complete, then the layer is materialised
  afresh, loaded, post-processed (CPU linear layers repack their weights, quantised
  layers re-quantise) and copied into the storage the kernels and CUDA graphs point
  at. Needed on CPU and for quantised models.
- ``direct``: into the live parameters (vLLM's own loaders fuse qkv / gate_up and
  shard for TP, copying in place). No second copy of the weights and no per-layer
  materialisation; only for unquantised models on GPUs, where the loaded tensors
  are the ones the kernels read. ``auto`` picks it there. The first sync of a layout
  calls ``model.load_weights`` and learns from it where each received tensor lands
  (``disagg.transport.copyplan``); later syncs replay that as one fused copy per
  bucket, straight from the receive buffer, while the next bucket is on the wire (a
  tensor split over buckets part by part as its buckets arrive, never assembled).

A sync is one call into the worker (``DisaggWorkerExtension.disagg_sync``: start,
update and finish, returning the receive's figures), and the manifest crosses into
the worker only when its layout changes (the worker keeps it by layout digest).

Each update records where its time went (``last_stats``: wire, load, reload set-up
and finalisation) for the engine's sync report.

This module is the only place that touches vLLM's model internals.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from disagg.errors import ChecksumError, DeltaRefused, SyncCancelled
from disagg.logs import traced
from disagg.rollout.vllm import api as vllm_api
from disagg.transport.buckets import PartLoader
from disagg.transport.copyplan import BucketReplay, CopyPlan, Recorded, learn
from disagg.transport.delta import DeltaImage
from disagg.transport.group import create_group, timed_raw_broadcasts
from disagg.transport.manifest import BucketPlan, Manifest
from disagg.transport.model_transfer import armed_go, receive_model

log = logging.getLogger("disagg.rollout.transfer")


@dataclass
class DisaggInitInfo(WeightTransferInitInfo):
    groups: list  # [host, port, group name] per source group (one per sending trainer rank)
    world_size: int
    rank_offset: int
    backend: str
    timeout_s: float
    source: str = "gather"
    num_buffers: int = 2
    verify: bool = False
    load: str = "auto"  # transport.load: auto | layerwise | direct
    delta: bool = False  # transport.delta on or auto: receive with receive_delta onto an image per group
    high_priority: bool = False  # transport.nccl_high_priority: the group's stream at the highest CUDA priority
    signals: str = "store"  # transport.signals: the group's words through its store or to doorbells (sockets)


def resolve_load_mode(requested: str, device_type: str, quantized: bool) -> str:
    """``transport.load`` for a worker on ``device_type`` (pure): 'layerwise' or 'direct'."""
    if requested not in ("auto", "layerwise", "direct"):
        raise ValueError(f"transport.load must be auto, layerwise or direct, got {requested!r}")
    if requested == "auto":
        return "direct" if device_type == "cuda" and not quantized else "layerwise"
    if requested == "direct" and (device_type != "cuda" or quantized):
        why = "a quantised model" if quantized else f"a {device_type} worker (its linear layers repack their weights)"
        raise ValueError(f"transport.load='direct' cannot load into {why}: use 'layerwise' or 'auto'")
    return requested


@dataclass
class DisaggUpdateInfo(WeightTransferUpdateInfo):
    manifest: dict | None = None  # the whole manifest; None: the one this worker holds, at ``policy_version``
    digest: str = ""  # the layout digest of the manifest meant (checked against the one held)
    policy_version: int = 0
    arm_id: int = 0  # an armed receive (waits for its word first: transport.signals); 0: not armed
    arm_timeout_s: float = 0.0  # how long an armed receive waits for that word
    arm_header: bool = False  # the trainer's push is armed too: its header is taken before the word


class DisaggWeightTransferEngine(WeightTransferEngine[DisaggInitInfo, DisaggUpdateInfo]):
    """Receives disagg's bucketed broadcasts and loads them into the vLLM model.

    The layerwise reload starts lazily, right before the first tensors are loaded:
    with ``verify`` that is after every bucket's checksum matched, so a rejected
    version never touches the model and the engine keeps serving the previous one.
    """

    init_info_cls = DisaggInitInfo
    update_info_cls = DisaggUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: list = []
        self.images: list | None = None  # transport.delta: per group, the version this worker holds (DeltaImage)
        self.info: DisaggInitInfo | None = None
        self.last_stats: dict[str, Any] = {}
        self._reloading = False
        self.load_mode = "layerwise"
        self._times: dict[str, float] = {}
        self._manifest: Manifest | None = None  # the last layout received (the update info may omit it)
        # direct loads: (layout digest, where the parameters live) -> the copy plan its first sync
        # learned (None: the loader cannot be replayed); the copies learned so far in the sync that
        # is learning one. A reload that moves parameters makes another key: the plan is learned again.
        self._plans: dict[tuple, CopyPlan | None] = {}
        self._learning: Recorded | None = None
        self._plan_key: tuple | None = None
        self._plan_note = ""

    def init_transfer_engine(self, init_info: DisaggInitInfo) -> None:
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.shutdown()
        self.info = init_info
        self.set_load_mode(init_info.load)
        self.groups = [
            create_group(host=host, port=int(port), rank=rank, world_size=init_info.world_size,
                         backend=init_info.backend, timeout_s=init_info.timeout_s, group_name=name, device=self.device,
                         high_priority=init_info.high_priority, signals=init_info.signals)
            for host, port, name in init_info.groups
        ]
        # New groups: this worker holds nothing of the trainer's yet, and the first sync is dense.
        self.images = [DeltaImage(self.device) for _ in self.groups] if init_info.delta else None
        log.info("[rollout] joined %d transport group(s) as rank %d/%d (load %s%s)", len(self.groups), rank,
                 init_info.world_size, self.load_mode, ", delta syncs" if init_info.delta else "")

    def set_load_mode(self, requested: str) -> str:
        """Load the next updates as ``requested`` (``transport.load``) resolves for this worker; the mode."""
        self.load_mode = resolve_load_mode(requested, self.device.type,
                                           getattr(self.vllm_config, "quant_config", None) is not None)
        return self.load_mode

    def start_weight_update(self) -> None:
        self._reloading = False
        self._times = {"load_s": 0.0, "reload_init_s": 0.0, "finalize_s": 0.0}

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        if self.load_mode == "direct":
            # Copies into the live parameters are made before this returns (on the stream, before
            # the next receive into this buffer): views of the receive buffer need no copy of their own.
            self._load_direct(tensors)
        else:
            if not self._reloading:
                vllm_api.begin_layerwise_reload(self.model)
                self._reloading = True
                t1 = time.perf_counter()
                self._times["reload_init_s"] += t1 - t0
                t0 = t1
            # vLLM's layerwise reload holds the tensors it is given until their layer is
            # complete, which may be after the receive buffer they view was reused for a
            # later bucket: hand it copies of views.
            self.model.load_weights([(n, t.clone() if t._base is not None else t) for n, t in tensors])
        self._times["load_s"] = self._times.get("load_s", 0.0) + time.perf_counter() - t0

    def _load_direct(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Replay the layout's copy plan; without one, vLLM's ``load_weights``, learning the plan."""
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
                log.warning("[rollout] direct loads stay with vLLM's load_weights, whose work is more than "
                            "copies to replay: %s", why)
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

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on
        # a machine with no accelerator; our receive synchronises the stream itself.
        self.receive_weights(self.parse_update_info(update_info))

    def _manifest_for(self, info: DisaggUpdateInfo) -> Manifest:
        if info.manifest is not None:
            self._manifest = Manifest.from_dict(info.manifest)
        elif self._manifest is None or self._manifest.layout_digest() != info.digest:
            held = self._manifest.layout_digest() if self._manifest is not None else None
            raise RuntimeError(f"disagg weight transfer: update without a manifest for layout {info.digest!r}, "
                               f"this worker holds {held!r}")
        else:
            self._manifest = self._manifest.with_version(info.policy_version)
        return self._manifest

    def receive_weights(self, update_info: DisaggUpdateInfo) -> None:
        if not self.groups or self.info is None:
            raise RuntimeError("disagg weight transfer: init_weight_transfer_engine was never called")
        manifest = self._manifest_for(update_info)
        digest = manifest.layout_digest()
        self.last_stats = {"policy_version": manifest.policy_version, "rejected": None, "load_mode": self.load_mode,
                           "signals": self.groups[0].signals}  # how this worker's groups take their words
        self._plan_key = None
        if self.load_mode == "direct":
            # where every parameter's memory lives now (a few hundred pointers: microseconds)
            self._plan_key = (digest, tuple(p.untyped_storage().data_ptr() for p in self.model.parameters()))
            if len(self._plans) > 4 and self._plan_key not in self._plans:
                self._plans.clear()
        learning = self.load_mode == "direct" and self._plan_key not in self._plans
        self._learning = Recorded({}, {}) if learning else None
        # A replayed plan copies each part of a tensor split over buckets as it arrives: no tensor
        # of up to a gigabyte (a 7B vocabulary) assembled on the engine's GPU first, and one copy less.
        # Where the plan covers the whole layout (one group's dense receive), each bucket is loaded at
        # once: one fused copy.
        plan = self._plans.get(self._plan_key) if self.load_mode == "direct" else None
        by_parts = plan is not None and not self.info.verify and self.images is None
        replay = plan.bucket_replay(manifest) if by_parts and self.info.source == "gather" else None
        parts = (PartLoader(plan.part_names, self._load_part,
                            bucket=None if replay is None else functools.partial(self._load_bucket, replay))
                 if by_parts else None)
        self._plan_note = ("learned" if learning else "replayed by bucket" if replay is not None
                           else "replayed" if plan is not None else "loader" if self.load_mode == "direct" else "")
        go = None
        if update_info.arm_id:
            wait = armed_go(update_info.arm_id, update_info.arm_timeout_s,
                            f"the trainer's push of version {manifest.policy_version} (armed receive "
                            f"{update_info.arm_id})")

            def go(group) -> None:
                t = time.perf_counter()
                try:
                    wait(group)
                finally:  # the wait before the announce: not part of the sync's time
                    self._times["armed_wait_s"] = max(self._times.get("armed_wait_s", 0.0), time.perf_counter() - t)
                    self._times["armed_go_unix_s"] = time.time()  # the sync's part starts here
        try:
            # A delta loads every tensor where vLLM's layerwise reload needs whole layers, and where a
            # copy plan is being learned (it must see every tensor); direct loads replay only what changed.
            stats = receive_model(self.groups, manifest, self._load, device=self.device, source=self.info.source,
                                  num_buffers=self.info.num_buffers, verify=self.info.verify, go=go,
                                  images=self.images, load_unchanged=self.load_mode != "direct" or learning,
                                  parts=parts, header_first=update_info.arm_header)
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
            # A broken broadcast leaves vLLM's layerwise reload half done (some layers on the meta
            # device): finish it, so the model is whole again - part old, part new weights, never
            # served (the engine's gate stays closed) - and the next sync can reload it.
            if self._reloading:
                try:
                    self.finish_weight_update()
                except Exception as e:  # noqa: BLE001 - the receive's own error is the one raised
                    log.error("[rollout] could not finish the interrupted weight reload: %s", e)
            raise
        if self._learning is not None:  # the whole version went through vLLM's loader, each copy recorded
            self._plans[self._plan_key] = CopyPlan(self._learning)
            self._learning = None
            log.info("[rollout] direct loads replay %d copies learned from vLLM's load_weights",
                     self._plans[self._plan_key].num_copies)
        self.last_stats.update(bytes=stats.bytes, seconds=stats.seconds, num_buckets=stats.num_buckets,
                               num_tensors=stats.num_tensors, copy_plan=self._plan_note,
                               wire_start_unix_s=stats.header_unix_s, wire_end_unix_s=stats.wire_end_unix_s,
                               worker_posted_unix_s=stats.posted_unix_s,
                               loaded_unix_s=stats.loaded_unix_s, **self._times)

    def finish_weight_update(self) -> None:
        if not self._reloading:
            return
        t0 = time.perf_counter()
        vllm_api.end_layerwise_reload(self.model, self.model_config)
        self._reloading = False
        self._times["finalize_s"] = time.perf_counter() - t0
        self.last_stats["finalize_s"] = self._times["finalize_s"]

    def shutdown(self) -> None:
        for g in self.groups:
            g.destroy()
        self.groups = []

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM's trainer-side hook (abstract in vLLM 0.26). disagg's trainers send through
        ``disagg.transport`` (TrainerWorker.push_weights), never through this class."""
        raise NotImplementedError("disagg trainers send weights with disagg.transport, not the vLLM backend class")


class DisaggWorkerExtension:
    """Methods added to vLLM's worker (``worker_extension_cls``) for disagg's own queries."""

    def disagg_arm_fault(self, point: str, action: str, after: int) -> None:
        from disagg import faults

        faults.arm(point, action, after)

    def disagg_transfer_stats(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.last_stats) if engine is not None else {}

    def disagg_sync(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """One weight update in one call from the engine actor: vLLM's start, update and finish (the
        worker's own methods, as ``AsyncLLM`` calls them one round trip each); the receive's figures.
        After ``disagg_trace_next_sync`` it runs under ``torch.profiler`` (``trace``: the file)."""
        path, self._disagg_trace = getattr(self, "_disagg_trace", None), None
        device = getattr(self.weight_transfer_engine, "device", None)
        return traced(path, getattr(device, "type", "") == "cuda", lambda: self._disagg_sync(update_info))

    def _disagg_sync(self, update_info: dict[str, Any]) -> dict[str, Any]:
        entered = time.time()
        self.start_weight_update()
        self.update_weights(update_info)
        self.finish_weight_update()
        return dict(self.weight_transfer_engine.last_stats, worker_in_unix_s=entered, worker_out_unix_s=time.time())

    def disagg_trace_next_sync(self, path: str) -> str:
        """Benchmarks: the next ``disagg_sync`` of this worker (its receive loop, loads and vLLM's
        start / finish) runs under ``torch.profiler`` and is written as a Chrome trace to ``path``
        with this worker's rank before its suffix; returns that file's path."""
        from pathlib import Path

        p = Path(path)
        self._disagg_trace = str(p.with_name(f"{p.stem}.w{getattr(self, 'rank', 0)}{p.suffix}"))
        return self._disagg_trace

    def disagg_set_load_mode(self, mode: str) -> str:
        """``disagg bench vllm-sync``: load the next updates with ``mode`` (``transport.load``); the mode resolved."""
        return self.weight_transfer_engine.set_load_mode(mode)

    def disagg_param_checksums(self) -> dict[str, list[int]]:
        """Each vLLM parameter's bit checksum (``bucket_checksum``): the test that a sync left every
        parameter equal to the trainer's, bit for bit, without moving the weights anywhere."""
        from disagg.transport.buckets import bucket_checksum

        model = self.weight_transfer_engine.model
        return {name: bucket_checksum(p.detach().reshape(-1)).tolist() for name, p in model.named_parameters()}

    def disagg_peer_init(self, init_info: dict[str, Any]) -> None:
        """``disagg bench vllm-sync --peer vllm-nccl``: join a group with the trainer through vLLM's own
        NCCL weight-transfer engine, kept beside disagg's (``disagg_peer_use`` swaps them)."""
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        ours = self.weight_transfer_engine
        peer = NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"), ours.vllm_config, ours.device, ours.model)
        peer.init_transfer_engine(peer.parse_init_info(init_info))
        self._disagg_engines = {"disagg": ours, "vllm-nccl": peer}

    def disagg_peer_use(self, name: str) -> None:
        """The weight-transfer engine vLLM's start / update / finish calls go to: "disagg" or "vllm-nccl"."""
        self.weight_transfer_engine = self._disagg_engines[name]

    def disagg_ckpt_receive(self, zmq_handles: dict[str, str], timeout_s: float) -> dict[str, float]:
        """``disagg bench vllm-sync --peer checkpoint-engine``: one update from the ParameterServer rank on this
        GPU, loaded as checkpoint-engine's own ``VllmColocateWorkerExtension`` loads it: vLLM's ``load_weights``
        per bucket (into the live parameters), then ``process_weights_after_loading``. Its seconds."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        from disagg.peers.ckpt_engine import worker_receive

        model = self.model_runner.model
        return worker_receive(zmq_handles, self.device.index, model.load_weights,
                              lambda: process_weights_after_loading(model, self.model_config, self.device), timeout_s)

    def disagg_raw_receive(self, nbytes: int, repeats: int) -> list[float]:
        """``disagg bench vllm-sync``: take part in ``repeats`` raw broadcasts of ``nbytes`` from the trainer
        on this worker's first transport group (the baseline of a sync's rate); each one's seconds."""
        # disagg's engine, also while the peer's is the one vLLM's calls go to (``disagg_peer_use``)
        engine = getattr(self, "_disagg_engines", {}).get("disagg", getattr(self, "weight_transfer_engine", None))
        if engine is None or not engine.groups:
            raise RuntimeError("disagg_raw_receive: the worker has not joined a transport group")
        return timed_raw_broadcasts(engine.groups[0], nbytes, repeats, engine.device)



def peer_trainer_init(host: str, port: int, world_size: int):
    """``disagg bench vllm-sync --peer vllm-nccl``, the trainer's side: vLLM's own NCCL group (rank 0)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    return NCCLWeightTransferEngine.trainer_init({"master_address": host, "master_port": port, "world_size": world_size})


def peer_trainer_send(group, named_tensors, dtype: torch.dtype) -> None:
    """Send ``named_tensors`` cast to ``dtype`` as vLLM's own NCCL engine does (packed, its default buffers)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

    NCCLWeightTransferEngine.trainer_send_weights(
        iter(named_tensors), NCCLTrainerSendWeightsArgs(group=group, packed=True,
                                                        post_iter_func=lambda item: item[1].to(dtype)))
    torch.cuda.synchronize()  # vLLM's producer returns with its last broadcast in flight on a stream of its own
