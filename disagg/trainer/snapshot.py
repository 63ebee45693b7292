"""Copies of the trainer's parameters that a weight push sends while the next step trains.

With ``transport.overlap_push`` every train step ends by copying the parameters (the
local shards under FSDP) into a snapshot labelled with the policy version they
become. The push of that version reads the snapshot from another thread, so the
optimizer may change the live parameters meanwhile. Two snapshots are kept: the
one being pushed (or pushed again after a failed sync) and the next version's.

A snapshot of flat parameters (``flatten_parameters``) is flat too, with every
tensor at the same offset, so the sender still sends each bucket as a view
without packing. This module never imports Ray or vLLM.
"""

from __future__ import annotations

import threading

import torch

from disagg.errors import TransportError

KEEP = 2


class Snapshot:
    """One copy of a set of named tensors, refilled in place; ``lock`` is held while it is read or written."""

    def __init__(self, params: dict[str, torch.Tensor], flats: list[torch.Tensor] | None = None) -> None:
        self.lock = threading.Lock()
        self.version: int | None = None
        self.event = None  # CUDA: recorded after the copy, waited for by the pushing stream
        self._key = _key(params)
        storages = {f.untyped_storage().data_ptr(): f for f in flats or []}
        if storages and all(t.untyped_storage().data_ptr() in storages for t in params.values()):
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

    def fits(self, params: dict[str, torch.Tensor]) -> bool:
        """The live tensors are still the ones this snapshot was laid out for (same names and memory)."""
        return _key(params) == self._key

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

    def take(self, version: int, params: dict[str, torch.Tensor], flats: list[torch.Tensor] | None = None) -> Snapshot:
        """Copy ``params`` as ``version`` into a free slot (the oldest version's when all are used;
        waits while that one is being pushed)."""
        with self._lock:
            if len(self._slots) < self._keep:
                slot = Snapshot(params, flats)
                self._slots.append(slot)
            else:
                slot = min(self._slots, key=lambda s: -1 if s.version is None else s.version)
        with slot.lock:
            if not slot.fits(params):  # parameters were replaced (a reload): lay the copy out again
                fresh = Snapshot(params, flats)
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


def _key(params: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, t.data_ptr(), tuple(t.shape), t.dtype) for n, t in params.items())
