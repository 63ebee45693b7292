"""Copies of the trainer's parameters that a weight push sends while the next step trains.

With ``transport.overlap_push`` every train step ends by copying the parameters (the
local shards under FSDP) into a snapshot labelled with the policy version they
become. The push of that version reads the snapshot from another thread, so the
optimizer may change the live parameters meanwhile. Two snapshots are kept: the
one being pushed (or pushed again after a failed sync) and the next version's.

Given the layout the push sends (the manifest's buckets), a snapshot is taken straight into
it: one flat buffer per wire dtype, every tensor cast to its wire dtype at its place in the
buckets (one fused copy). The sender then sends each bucket as a view, with no packing
or cast in the push, and a bf16 wire keeps half the bytes of float32 parameters. Without
one, a snapshot of flat parameters (``flatten_parameters``) is flat too, with every tensor
at the same offset, and other parameters are copied tensor by tensor as they are (the push
packs them). This module never imports Ray or vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from disagg.errors import TransportError
from disagg.transport.buckets import torch_dtype
from disagg.transport.manifest import BucketPlan

KEEP = 2


def wire_offsets(buckets: Sequence[BucketPlan]) -> dict[str, tuple[str, int]] | None:
    """Where each tensor starts when ``buckets`` lie back to back, one flat buffer per dtype:
    name -> (dtype, element offset); None if some tensor's parts would not be contiguous there
    (a bucket is then not one view of a tensor-ordered copy)."""
    fill: dict[str, int] = {}
    starts: dict[str, tuple[str, int]] = {}
    for plan in buckets:
        base = fill.get(plan.dtype, 0)
        for e in plan.entries:
            start = (plan.dtype, base + e.bucket_offset - e.tensor_offset)
            if starts.setdefault(e.name, start) != start:
                return None
        fill[plan.dtype] = base + plan.numel
    return starts


class Snapshot:
    """One copy of a set of named tensors, refilled in place; ``lock`` is held while it is read or written."""

    def __init__(self, params: dict[str, torch.Tensor], flats: list[torch.Tensor] | None = None,
                 wire: Sequence[BucketPlan] | None = None) -> None:
        self.lock = threading.Lock()
        self.version: int | None = None
        self.event = None  # CUDA: recorded after the copy, waited for by the pushing stream
        self._key = _key(params, wire)
        storages = {f.untyped_storage().data_ptr(): f for f in flats or []}
        starts = wire_offsets(wire) if wire else None
        if starts is not None and set(starts) == {n for n, t in params.items() if n in starts or t.numel()}:
            # Laid out as the push's buckets, in the wire dtypes: every bucket a view of the copy.
            sizes: dict[str, int] = {}
            for plan in wire:
                sizes[plan.dtype] = sizes.get(plan.dtype, 0) + plan.numel
            device = next(iter(params.values())).device
            image = {d: torch.empty(n, dtype=torch_dtype(d), device=device) for d, n in sizes.items()}
            self.tensors = {}
            for name, t in params.items():
                if name in starts:
                    dtype, start = starts[name]
                    self.tensors[name] = image[dtype][start : start + t.numel()].view(t.shape)
                else:  # no elements on this rank (an FSDP shard of nothing): nothing to send or copy
                    self.tensors[name] = t.new_empty(t.shape)
            self._src = [params[n] for n in starts]
            self._dst = [self.tensors[n] for n in starts]
        elif storages and all(t.untyped_storage().data_ptr() in storages for t in params.values()):
            # Mirror the flat buffers: each tensor a view at the same offset of the copy.
            self._src = list(storages.values())
            self._dst = [torch.empty_like(f) for f in self._src]
            copy_of = {ptr: d for ptr, d in zip(storages, self._dst)}
            self.tensors = {}
            for name, t in params.items():
                ptr = t.untyped_storage().data_ptr()
                offset = t.storage_offset() - storages[ptr].storage_offset() + copy_of[ptr].storage_offset()
                self.tensors[name] = copy_of[ptr].as_strided(t.shape, t.stride(), offset)
        else:
            self._src = list(params.values())
            self._dst = [torch.empty_like(t) for t in self._src]
            self.tensors = dict(zip(params, self._dst))

    def fits(self, params: dict[str, torch.Tensor], wire: Sequence[BucketPlan] | None = None) -> bool:
        """The live tensors (and the push's layout) are still the ones this snapshot was laid out for."""
        return _key(params, wire) == self._key

    @torch.no_grad()
    def fill(self, version: int) -> None:
        torch._foreach_copy_(self._dst, self._src)
        if self._dst and self._dst[0].is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.version = version

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._dst)


class Snapshots:
    """The last ``KEEP`` snapshots by policy version (thread-safe: taken on the training thread,
    read on the pushing one)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._slots: list[Snapshot] = []
        self._lock = threading.Lock()

    def take(self, version: int, params: dict[str, torch.Tensor], flats: list[torch.Tensor] | None = None,
             wire: Sequence[BucketPlan] | None = None) -> Snapshot:
        """Copy ``params`` as ``version`` into a free slot (the oldest version's when all are used;
        waits while that one is being pushed); ``wire``: the buckets the push sends (see Snapshot)."""
        with self._lock:
            if len(self._slots) < self._keep:
                slot = Snapshot(params, flats, wire)
                self._slots.append(slot)
            else:
                slot = min(self._slots, key=lambda s: -1 if s.version is None else s.version)
        with slot.lock:
            if not slot.fits(params, wire):  # parameters were replaced (a reload): lay the copy out again
                fresh = Snapshot(params, flats, wire)
                with self._lock:
                    self._slots[self._slots.index(slot)] = fresh
                slot = fresh
            slot.fill(version)
        return slot

    def get(self, version: int) -> Snapshot:
        with self._lock:
            for s in self._slots:
                if s.version == version:
                    return s
            have = sorted(s.version for s in self._slots if s.version is not None)
        raise TransportError(f"no snapshot of policy version {version} on this trainer worker (have {have}): "
                             f"a push can only send one of the last {self._keep} trained versions")

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(s.version for s in self._slots if s.version is not None)


def _key(params: dict[str, torch.Tensor], wire: Sequence[BucketPlan] | None = None) -> tuple:
    return (tuple((n, t.data_ptr(), tuple(t.shape), t.dtype) for n, t in params.items()),
            None if wire is None else tuple(wire))
