"""Model-level weight sync: which trainer ranks send what, and how receivers rebuild it.

Two source modes for a trainer sharded with FSDP2 over R ranks:

- ``gather``: every rank walks the buckets in order and gathers each bucket's
  tensors from their shards straight into a bucket buffer (a collective, so all
  ranks walk in lockstep, see ``ShardGatherer``); rank 0 broadcasts the buffer over
  its group while the next bucket is being gathered. Extra memory on rank 0: its
  bucket buffers.
- ``shards``: no gather. Trainer rank r broadcasts its own dim-0 shards over its
  own group (rank r is that group's rank 0, every receiver is in every group);
  receivers receive from all R groups at once and concatenate the shards before
  loading. Separate groups are separate communicators, so the R sources really
  send in parallel and the aggregate grows with the trainer's links.

Shard sizes follow FSDP2's dim-0 ``torch.chunk`` split, a pure function of the
full shape and R, so receivers derive every source's manifest from the one
manifest the coordinator holds. This module never imports vLLM or Ray.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from disagg.errors import TransportError
from disagg.transport.buckets import PartLoader, bucket_buffers, torch_dtype
from disagg.transport.delta import DeltaImage
from disagg.transport.group import TransportGroup
from disagg.transport.manifest import Manifest, TensorSpec, plan_buckets
from disagg.transport.receiver import LoadFn, ReceiveStats, receive_delta, receive_weights
from disagg.transport.packing import BucketFill
from disagg.transport.sender import EarlyPack, SendStats, WeightSender, build_manifest

SOURCES = ("gather", "shards")


def model_manifest(model: torch.nn.Module, bucket_bytes: int, policy_version: int, dtype: str | None = None,
                   first_bucket_bytes: int = 0) -> Manifest:
    """The full-tensor manifest of ``model`` (DTensors contribute their global shape); its buckets
    ramp from ``first_bucket_bytes`` (``plan_buckets``; 0: none)."""
    return build_manifest(model.named_parameters(), bucket_bytes, policy_version, dtype, first_bucket_bytes)


def shard_sizes(dim0: int, num_sources: int) -> list[int]:
    """Dim-0 length of each rank's FSDP2 shard: ``torch.chunk`` split, trailing ranks may get 0."""
    chunk = math.ceil(dim0 / num_sources) if dim0 else 0
    sizes, left = [], dim0
    for _ in range(num_sources):
        take = min(chunk, left)
        sizes.append(take)
        left -= take
    return sizes


def source_manifests(full: Manifest, num_sources: int) -> list[Manifest]:
    """One manifest per source: its shard of every tensor, bucketed like ``full`` (its ramp too).

    A 0-dim tensor cannot be sharded: source 0 sends it whole.
    """
    out = []
    for r in range(num_sources):
        specs = []
        for t in full.tensors:
            if not t.shape:
                if r == 0:
                    specs.append(t)
                continue
            n = shard_sizes(t.shape[0], num_sources)[r]
            if n:
                specs.append(TensorSpec(t.name, (n, *t.shape[1:]), t.dtype))
        out.append(plan_buckets(specs, full.bucket_bytes, full.policy_version, full.first_bucket_bytes))
    return out


def _materialise(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def send_model(group: TransportGroup | None, model: torch.nn.Module, full: Manifest, *, source: str,
               trainer_rank: int, num_trainer_ranks: int, num_buffers: int = 2, verify: bool = False,
               sender: WeightSender | None = None, params: Mapping[str, torch.Tensor] | None = None,
               image: DeltaImage | None = None, dense: bool = False, estimate: bool = False,
               go: Callable[[], None] | None = None, early: EarlyPack | None = None) -> SendStats | None:
    """Send ``model``'s parameters as ``full.policy_version``; call on every trainer rank.

    ``group`` is this rank's source group (None for non-zero ranks in gather mode).
    ``params`` is ``dict(model.named_parameters())`` made once by a caller that syncs
    often (walking the module tree costs about a millisecond per sync); the
    parameters must then be updated in place, as optimizers and ``load_state_dict``
    do. ``image`` (``transport.delta``): this rank's image of what its group's receivers hold; the
    send is then ``WeightSender.send_delta`` (``dense``: a dense one that keeps the image). ``go``:
    an armed push's wait for the driver's word (``Arm.push_waits``), once the send is set up
    (``WeightSender.send``; not with gathers over several ranks, whose collectives cannot wait); a
    dense send's header then goes out before the word, as every armed receive takes it before its own
    (``receive_model``); ``early``: its first buckets may be packed as the step ends, before the word
    (``EarlyPack``; dense sends). Returns the send statistics on ranks that sent, None on ranks that
    only gathered.
    """
    params = dict(model.named_parameters()) if params is None else params
    device = next(iter(params.values())).device  # buckets are packed there (WeightSender)

    def send(manifest: Manifest, tensors=None, fill=None) -> SendStats:
        s = sender or WeightSender(group, 0, num_buffers, verify, device=device)
        if image is None:
            return s.send(manifest, tensors, fill, go=go, early=early, header_first=go is not None)
        return s.send_delta(manifest, image, tensors, fill, dense=dense, estimate=estimate, go=go)

    if source == "gather":
        if num_trainer_ranks == 1:  # nothing to gather: the parameters themselves (zero-copy when flat)
            return send(full, params)
        if go is not None:
            raise ValueError(f"an armed push cannot gather over {num_trainer_ranks} trainer ranks (source=gather)")
        gatherer = ShardGatherer(params, full)
        if trainer_rank != 0:
            # Take part in every gather, in the same order as rank 0, into scratch buffers
            # (kept across syncs, as rank 0 keeps its bucket buffers).
            scratch = _scratch_buffers(full, device, gatherer.slack, max(num_buffers, 1))
            for i, plan in enumerate(full.buckets):
                gatherer(plan, scratch[i % len(scratch)][plan.dtype])
            return None
        return send(full, fill=gatherer)
    if source != "shards":
        raise ValueError(f"transport.source must be one of {SOURCES}, got {source!r}")
    mine = source_manifests(full, num_trainer_ranks)[trainer_rank]
    local = {t.name: _local(params[t.name]) for t in mine.tensors}
    for t in mine.tensors:
        if tuple(local[t.name].shape) != t.shape:
            raise TransportError(f"trainer rank {trainer_rank}: local shard of {t.name!r} has shape "
                                 f"{tuple(local[t.name].shape)}, expected {t.shape} (dim-0 FSDP2 sharding)")
    return send(mine, local)


_SCRATCH: dict[tuple, list[dict[str, torch.Tensor]]] = {}


def _scratch_buffers(full: Manifest, device: torch.device, slack: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Bucket buffers for a gather rank that sends nothing, reused across syncs of one layout.

    One set per process (a process is one trainer rank), replaced when the layout changes.
    """
    key = (full.layout_digest(), str(device), slack, count)
    if key not in _SCRATCH:
        _SCRATCH.clear()
        _SCRATCH[key] = [bucket_buffers(full, device, slack) for _ in range(count)]
    return _SCRATCH[key]


class ShardGatherer(BucketFill):
    """Fills a bucket with full tensors gathered from FSDP2 dim-0 shards, in place.

    A tensor that lies whole in the bucket and is sharded on dim 0 is gathered by one
    ``all_gather_into_tensor`` straight into its place in the bucket: no full-tensor
    allocation and no packing copy, so a rank's extra memory is its bucket buffers.
    The gather writes each rank's padded chunk, so up to ``slack`` elements spill past
    the tensor; entries are filled in bucket order, so the next entry overwrites the
    spill, and buffers carry ``slack`` spare elements at the end. A part of a tensor
    larger than a bucket is filled in place too: dim-0 shards are contiguous element
    ranges of the flattened tensor, so each rank whose range meets the part copies
    its piece into the bucket and broadcasts it to the others. Only a tensor cast to
    another wire dtype (or not sharded on dim 0) is materialised with
    ``full_tensor()`` (kept while its parts are being filled) and copied. Every rank
    must fill every bucket in the same order: each fill runs collectives over the
    trainer ranks.
    """

    def __init__(self, params: dict[str, torch.Tensor], manifest: Manifest):
        self._params = params
        self._specs = {t.name: t for t in manifest.tensors}
        self._cached: tuple[str, torch.Tensor] | None = None
        self.slack = 0
        for t in manifest.tensors:
            layout = self._direct(t.name, t)
            if layout is not None:
                _, per_rank, ranks = layout
                self.slack = max(self.slack, per_rank * ranks - t.numel)

    def _direct(self, name: str, spec: TensorSpec):
        """(mesh group, elements per rank chunk, ranks) if ``name`` can be gathered in place."""
        from torch.distributed.tensor import DTensor, Shard

        p = self._params[name]
        if not isinstance(p, DTensor) or not spec.shape or str(p.dtype).removeprefix("torch.") != spec.dtype:
            return None
        if p.device_mesh.ndim != 1 or p.placements != (Shard(0),):
            return None
        ranks = p.device_mesh.size()
        inner = spec.numel // spec.shape[0] if spec.shape[0] else 0
        return p.device_mesh.get_group(), math.ceil(spec.shape[0] / ranks) * inner, ranks

    def __call__(self, plan, buf: torch.Tensor) -> None:
        import torch.distributed as dist

        for e in plan.entries:
            spec = self._specs[e.name]
            layout = self._direct(e.name, spec)
            if layout is not None and e.numel != spec.numel:
                self._fill_part(e, spec, layout, buf)
                continue
            if layout is not None and spec.numel:
                group, per_rank, ranks = layout
                local = self._params[e.name].detach().to_local().reshape(-1)
                if local.numel() < per_rank:  # short (or empty) last chunks are padded
                    padded = torch.zeros(per_rank, dtype=local.dtype, device=local.device)
                    padded[: local.numel()].copy_(local)
                    local = padded
                dist.all_gather_into_tensor(buf[e.bucket_offset : e.bucket_offset + per_rank * ranks],
                                            local.contiguous(), group=group)
                continue
            if self._cached is None or self._cached[0] != e.name:
                self._cached = (e.name, _materialise(self._params[e.name]).reshape(-1))
            buf[e.bucket_offset : e.bucket_offset + e.numel].copy_(
                self._cached[1][e.tensor_offset : e.tensor_offset + e.numel])
            if e.tensor_offset + e.numel == spec.numel:
                self._cached = None


    def _fill_part(self, e, spec: TensorSpec, layout, buf: torch.Tensor) -> None:
        """Fill the element range ``e`` of a dim-0-sharded tensor: one broadcast per rank holding a piece."""
        import torch.distributed as dist

        group, per_rank, ranks = layout
        me = dist.get_rank(group)
        local = self._params[e.name].detach().to_local().reshape(-1)
        lo, hi = e.tensor_offset, e.tensor_offset + e.numel
        for r in range(ranks):
            # Rank r holds elements [r * per_rank, min((r + 1) * per_rank, numel)) of the flat tensor.
            a, b = max(lo, r * per_rank), min(hi, (r + 1) * per_rank, spec.numel)
            if a >= b:
                continue
            piece = buf[e.bucket_offset + a - lo : e.bucket_offset + b - lo]
            if me == r:
                piece.copy_(local[a - r * per_rank : b - r * per_rank])
            dist.broadcast(piece, src=dist.get_global_rank(group, r), group=group)


class ShardAssembler:
    """Concatenates each tensor's dim-0 shards from all sources, then loads it.

    Thread-safe: every source's receive loop calls ``add`` from its own thread.
    With ``defer`` nothing is loaded until ``finish`` (verify mode: a version is
    loaded only if every source's buckets arrived intact).
    """

    def __init__(self, full: Manifest, num_sources: int, load_fn: LoadFn, device: torch.device, defer: bool):
        self._load_fn, self._device, self._defer = load_fn, device, defer
        self._specs = {t.name: t for t in full.tensors}
        self._offsets: dict[str, list[int]] = {}
        self._missing: dict[str, int] = {}
        for t in full.tensors:
            sizes = shard_sizes(t.shape[0], num_sources) if t.shape else [1] + [0] * (num_sources - 1)
            self._offsets[t.name] = [sum(sizes[:r]) for r in range(num_sources)]
            self._missing[t.name] = sum(1 for s in sizes if s)
        self._buffers: dict[str, torch.Tensor] = {}
        self._events: dict[str, list] = {}  # CUDA: each source's copy, to order the load after all of them
        self._ready: list[tuple[str, torch.Tensor]] = []
        self._lock = threading.Lock()

    def add(self, source: int, items: list[tuple[str, torch.Tensor]]) -> None:
        with self._lock:
            done = []
            for name, shard in items:
                spec = self._specs[name]
                if not spec.shape:
                    whole = shard.clone()
                else:
                    whole = self._buffers.get(name)
                    if whole is None:
                        whole = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self._device)
                        self._buffers[name] = whole
                    start = self._offsets[name][source]
                    whole[start : start + shard.shape[0]].copy_(shard)
                if whole.is_cuda:
                    # Written on this source's stream, allocated on maybe another one: keep the
                    # allocator from handing the block out again before this stream is done
                    # with it, and let the load (on whichever stream completes it) wait for it.
                    whole.record_stream(torch.cuda.current_stream())
                    event = torch.cuda.Event()
                    event.record()
                    self._events.setdefault(name, []).append(event)
                self._missing[name] -= 1
                if self._missing[name] == 0:
                    for event in self._events.pop(name, []):
                        torch.cuda.current_stream().wait_event(event)
                    done.append((name, self._buffers.pop(name, whole)))
            if self._defer:
                self._ready.extend(done)
            elif done:
                self._load_fn(done)

    def finish(self) -> None:
        incomplete = [n for n, k in self._missing.items() if k]
        if incomplete:
            raise TransportError(f"{len(incomplete)} tensors are missing shards (first {incomplete[:5]})")
        if self._ready:
            self._load_fn(self._ready)
            self._ready = []


def receive_model(groups: list[TransportGroup], full: Manifest, load_fn: LoadFn, *, device: torch.device,
                  source: str, num_buffers: int = 2, verify: bool = False, arm: Arm | None = None,
                  images: list[DeltaImage] | None = None, load_unchanged: bool = False,
                  parts: PartLoader | None = None) -> ReceiveStats:
    """Receive ``full.policy_version`` from one group (gather) or one group per trainer rank (shards).
    ``arm``: an armed receive, each group's waiting for its word first (``Arm.receive_go``); with
    ``arm.push_waits`` a dense receive takes each group's header before that word (a delta's header
    follows its sender's word); the waits in ``go_wait_s`` / ``go_unix_s`` (the slowest group's). ``images``
    (``transport.delta``): one per group, received with ``receive_delta``; ``load_unchanged`` then
    loads every tensor, not only those that changed (a loader that needs whole layers; the shards
    of one tensor come from every group, so ``shards`` always does). ``parts``: a dense receive from
    one group hands the tensors split over buckets it names to it a part at a time
    (``receive_weights``); ignored where the receive is a delta or comes from several groups."""
    t0 = time.perf_counter()
    if images is not None and len(images) != len(groups):
        raise ValueError(f"{len(images)} delta images for {len(groups)} transport groups")
    go = arm.receive_go(full.policy_version) if arm is not None else None

    def receive(r: int, manifest: Manifest, load: LoadFn) -> ReceiveStats:
        if images is None:
            return receive_weights(groups[r], manifest, load, device, num_buffers=num_buffers, verify=verify, go=go,
                                   parts=parts if source == "gather" else None,
                                   header_first=arm is not None and arm.push_waits)
        return receive_delta(groups[r], manifest, load, images[r], device, verify=verify, go=go,
                             load_unchanged=load_unchanged or source == "shards")

    if source == "gather":
        if len(groups) != 1:
            raise ValueError(f"gather mode receives from one group, got {len(groups)}")
        return receive(0, full, load_fn)
    manifests = source_manifests(full, len(groups))
    # A delta loads nothing before its group's buckets all arrived; every group's, with the assembler deferring.
    assembler = ShardAssembler(full, len(groups), load_fn, device, defer=verify or images is not None)

    def one(r: int) -> ReceiveStats:
        if device.type != "cuda":
            return receive(r, manifests[r], lambda items: assembler.add(r, items))
        torch.cuda.set_device(device)  # a fresh thread starts on device 0
        # One stream per source: group r's NCCL stream then depends on nothing but its own
        # receives and copies. Through a shared stream, two communicators would wait on
        # each other in different orders on different receivers, a deadlock.
        with torch.cuda.stream(torch.cuda.Stream(device)):
            stats = receive(r, manifests[r], lambda items: assembler.add(r, items))
        return stats

    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="disagg-recv") as pool:
        futures = [pool.submit(one, r) for r in range(len(groups))]
        stats = [f.result() for f in futures]  # every source's error surfaces here
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every source stream's copies are done
    assembler.finish()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return ReceiveStats(bytes=sum(s.bytes for s in stats), seconds=time.perf_counter() - t0,
                        num_buckets=sum(s.num_buckets for s in stats), num_tensors=len(full.tensors),
                        header_s=max(s.header_s for s in stats), header_unix_s=max(s.header_unix_s for s in stats),
                        wire_end_unix_s=max(s.wire_end_unix_s for s in stats), loaded_unix_s=time.time(),
                        posted_unix_s=max(s.posted_unix_s for s in stats), go_wait_s=max(s.go_wait_s for s in stats),
                        go_unix_s=max(s.go_unix_s for s in stats))


ARM_SEND, ARM_CANCEL = "send", "cancel"


def arm_key(arm_id: int) -> str:
    """The store key an armed receive waits on and the trainer sets (``ARM_SEND`` or ``ARM_CANCEL``)."""
    return f"arm/{arm_id}"


def go_key(arm_id: int) -> str:
    """The store key an armed push waits on and the driver sets (``ARM_SEND`` after it announced the
    version, or ``ARM_CANCEL``): the trainer's side of an armed sync (``WeightSync.arm``)."""
    return f"go/{arm_id}"


def armed_go(arm_id: int, timeout_s: float, what: str) -> Callable[[TransportGroup], None]:
    """An armed receive's ``go`` (``receive_weights``): wait in the group's store until the sender says
    it is sending (its header follows at once); ``SyncCancelled`` if it calls the receive off."""
    from disagg.errors import SyncCancelled

    def go(group: TransportGroup) -> None:
        said = group.await_signal(arm_key(arm_id), timeout_s, what)
        if said != ARM_SEND:
            raise SyncCancelled(f"{what}: called off by the sender ({said!r}); nothing was received")

    return go


@dataclass(frozen=True)
class Arm:
    """One armed weight sync (``WeightSync.arm``), handed whole from the driver to the trainer's push and
    to every engine's receive: the parties are put on the transport group before the version exists
    and wait in each group's store for a word (``ARM_SEND`` or ``ARM_CANCEL``) before the wire starts.

    - Each engine's receive (``receive_model(arm=...)``) waits on ``arm_key(id)``, at most ``timeout_s``;
      called off, it returns having loaded nothing (``SyncCancelled``).
    - The trainer's push, where ``push_waits`` is False, is called after the announce: it says
      ``ARM_SEND`` on ``arm_key(id)`` and sends (its header right after the word). ``TrainerPush.disarm``
      says ``ARM_CANCEL`` there.
    - Where ``push_waits`` is True the push is armed too (``transport.overlap_push``): set up while the
      step trains, it waits on ``go_key(id)`` (at most ``timeout_s``) for the driver's word, which the
      driver sets on both keys at once (``WeightSync._go``). Its header goes out before that word and
      every receive takes it before its own, so that after the word only buckets are posted.

    It crosses into an engine's worker as a plain dict (``as_dict``, ``from_dict``): the engines
    serialise the update info they hand their workers."""

    id: int  # the driver's count of armed syncs (from 1): the store keys' suffix
    timeout_s: float  # how long each party waits for its word
    push_waits: bool = False  # the trainer's push waits for the driver's word too; its header goes first

    def as_dict(self) -> dict:
        """The plain dict an engine's worker gets in its update info (``DisaggUpdateInfo.arm``)."""
        return {"id": self.id, "timeout_s": self.timeout_s, "push_waits": self.push_waits}

    @classmethod
    def from_dict(cls, d: dict) -> Arm:
        """The ``Arm`` of ``as_dict``'s dict."""
        return cls(int(d["id"]), float(d["timeout_s"]), bool(d.get("push_waits", False)))

    def receive_go(self, policy_version: int) -> Callable[[TransportGroup], None]:
        """A receive's wait for its word (``armed_go`` on ``arm_key(id)``) of ``policy_version``."""
        return armed_go(self.id, self.timeout_s,
                        f"the trainer's push of version {policy_version} (armed receive {self.id})")


def source_groups_needed(source: str, num_trainer_ranks: int) -> int:
    """How many transport groups a sync uses: one, or one per trainer rank."""
    return 1 if source == "gather" else num_trainer_ranks


