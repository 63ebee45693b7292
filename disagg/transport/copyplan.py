"""Where each received tensor lands in a model: learned once from the model's own loader, replayed
as one fused copy per bucket.

A model's ``load_weights`` (vLLM's, for instance) maps every checkpoint tensor onto its parameters
with Python: per tensor it finds the parameter, narrows it to the shard (q, k and v into one fused
qkv parameter, gate and up into gate_up, a tensor-parallel rank's slice of the source) and copies.
That walk costs tens of milliseconds per sync for a 1.5B model, on the critical path of every sync,
while where the bytes go never changes.

``learn`` runs the loader once, under a dispatch mode that sees every tensor operation, and
records each ``copy_`` from a received tensor into parameter memory: which slice of which
received tensor, into which view of which parameter. ``CopyPlan.apply`` then replays those copies
for the next versions as one ``torch._foreach_copy_`` per bucket, straight from the receive buffer;
``BucketReplay`` lays them over a bucket layout once, so that a received bucket is loaded with no
Python per tensor.

The loader may also fill part of a parameter with a constant (vLLM zeroes an embedding's padding
rows after copying the vocabulary in): such fills are replayed after the copies of the same tensor.

The plan is exact or absent: if the loader did anything a replay would not redo - computed on a
received tensor (a cast, a transpose made contiguous, a sum), wrote into a parameter by any other
operation, or copied into memory that is not a parameter's - ``learn`` says why and returns no
plan, and the caller keeps calling the loader. This module never imports vLLM or Ray.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from disagg.transport.manifest import BucketPlan, Manifest

_METADATA_OPS = ("aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
                 "aten::is_same_size", "aten::_has_compatible_shallow_copy_type", "prim::")


@dataclass(frozen=True)
class PlannedCopy:
    """One copy the loader made: the received tensor's elements at ``(offset, size, stride)``
    (relative to the tensor's first element) into ``dst``, a view of a parameter."""

    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dst: torch.Tensor

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.as_strided(self.size, self.stride, tensor.storage_offset() + self.offset)


@dataclass(frozen=True)
class Recorded:
    """What a loader did with each received tensor: its copies into parameters, then its fills."""

    copies: dict[str, list[PlannedCopy]]
    fills: dict[str, list[tuple[torch.Tensor, float]]]

    def update(self, other: "Recorded") -> None:
        self.copies.update(other.copies)
        for name, fills in other.fills.items():
            self.fills.setdefault(name, []).extend(fills)


class CopyPlan:
    """Name -> the copies its tensor goes through. ``apply`` makes them for one bucket's tensors."""

    def __init__(self, recorded: Recorded) -> None:
        self.copies = recorded.copies
        self.fills = recorded.fills
        # name -> (the received tensor's address, its source views, their destinations): the
        # receive buffers are kept across syncs, so the views are made once per address.
        self._views: dict[str, tuple[int, list[torch.Tensor], list[torch.Tensor]]] = {}
        self._replays: dict[str, BucketReplay | None] = {}  # by layout digest (``bucket_replay``)

    @property
    def num_copies(self) -> int:
        return sum(len(c) for c in self.copies.values())

    @functools.cached_property
    def part_names(self) -> frozenset[str]:
        """The tensors whose every copy moves one run of consecutive elements into a contiguous view
        of a parameter (whole tensors, q / k / v into fused qkv, a vocabulary into a padded
        embedding): those can be copied a part at a time as they arrive (``apply_part``), so a
        tensor split over buckets is never assembled first."""
        return frozenset(name for name, copies in self.copies.items() if all(map(_one_run, copies)))

    def bucket_replay(self, manifest: Manifest) -> BucketReplay | None:
        """This plan laid over ``manifest``'s buckets (made once per layout), or None where a bucket
        cannot be loaded whole: it holds a name the plan never saw, or part of a split tensor that is
        not copied a part at a time (not in ``part_names``)."""
        key = manifest.layout_digest()
        if key not in self._replays:
            if len(self._replays) >= 4:  # a worker meets few layouts
                self._replays.clear()
            self._replays[key] = BucketReplay.of(self, manifest)
        return self._replays[key]

    def apply_part(self, name: str, part: torch.Tensor, offset: int, last: bool) -> None:
        """Copy elements ``[offset, offset + part.numel())`` of the received tensor ``name`` (``part``,
        1-D) where the loader put them; its fills after the ``last`` part. Only for ``part_names``."""
        with torch.no_grad():
            for at, n, dst in _runs_in_part(self.copies[name], offset, offset + part.numel()):
                dst.copy_(part[at : at + n])
            if last:
                for dst, value in self.fills.get(name, ()):
                    dst.fill_(value)

    def apply(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each received tensor where the loader put it: one fused call for all of them.
        Raises ``KeyError`` for a name the plan never saw (the caller learns again)."""
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        for name, t in tensors:
            copies = self.copies[name]
            if not copies:
                continue
            cached = self._views.get(name)
            if cached is None or cached[0] != t.data_ptr():
                cached = (t.data_ptr(), [c.source(t) for c in copies], [c.dst for c in copies])
                self._views[name] = cached
            srcs += cached[1]
            dsts += cached[2]
        with torch.no_grad():
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            if self.fills:
                for name, _ in tensors:
                    for dst, value in self.fills.get(name, ()):
                        dst.fill_(value)


class BucketReplay:
    """A copy plan laid over one bucket layout: every copy out of each bucket - whole tensors, and
    the parts of tensors split over buckets - in one list, so that a received bucket is loaded by
    one ``torch._foreach_copy_`` and no Python per tensor (``load``). Through the reassembler and
    ``CopyPlan.apply`` a bucket of ~100 tensors costs a receiver ~0.5 ms of host time, and the
    receive of the bucket that reuses its buffer is posted only after that."""

    def __init__(self, copies: list[list[tuple[int, tuple[int, ...], tuple[int, ...], torch.Tensor]]],
                 fills: list[list[tuple[torch.Tensor, float]]], completes: list[int]) -> None:
        self._copies = copies  # per bucket: (element offset in the bucket, size, stride, destination view)
        self._fills = fills  # per bucket: the fills of the tensors it completes, after its copies
        self._completes = completes  # per bucket: how many tensors end in it
        # per bucket: (the receive buffer's address, source views of it, destinations). A bucket
        # always lands in the same buffer, kept across syncs, so its views are made once; a buffer
        # made again (a rebuilt group) replaces them, and the old buffer is not held.
        self._views: list[tuple[int, list[torch.Tensor], list[torch.Tensor]] | None] = [None] * len(copies)

    @classmethod
    def of(cls, plan: CopyPlan, manifest: Manifest) -> BucketReplay | None:
        numel = {t.name: t.numel for t in manifest.tensors}
        copies, fills, completes = [], [], []
        for position, bucket in enumerate(manifest.buckets):
            if bucket.index != position:
                return None
            out: list[tuple[int, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []
            then: list[tuple[torch.Tensor, float]] = []
            ends = 0
            for e in bucket.entries:
                planned = plan.copies.get(e.name)
                if planned is None:
                    return None
                if e.numel == numel[e.name]:
                    out += [(e.bucket_offset + c.offset, c.size, c.stride, c.dst) for c in planned]
                elif e.name in plan.part_names:  # this part's share of each one-run copy
                    out += [(e.bucket_offset + at, (n,), (1,), dst)
                            for at, n, dst in _runs_in_part(planned, e.tensor_offset, e.tensor_offset + e.numel)]
                else:
                    return None
                if e.tensor_offset + e.numel == numel[e.name]:  # the tensor's last elements
                    then += plan.fills.get(e.name, [])
                    ends += 1
            copies.append(out)
            fills.append(then)
            completes.append(ends)
        return cls(copies, fills, completes)

    def load(self, bucket: BucketPlan, buf: torch.Tensor) -> int:
        """Copy received bucket ``bucket`` (``buf``, 1-D) where the loader put its bytes, the fills of
        the tensors it completes after; returns how many tensors that is (``PartLoader.bucket``)."""
        views = self._views[bucket.index]
        if views is None or views[0] != buf.data_ptr():
            base = buf.storage_offset()
            planned = self._copies[bucket.index]
            views = self._views[bucket.index] = (
                buf.data_ptr(), [buf.as_strided(size, stride, base + offset) for offset, size, stride, _ in planned],
                [dst for *_, dst in planned])
        with torch.no_grad():
            if views[2]:
                torch._foreach_copy_(views[2], views[1])
            for dst, value in self._fills[bucket.index]:
                dst.fill_(value)
        return self._completes[bucket.index]


def _runs_in_part(copies: list[PlannedCopy], lo: int, hi: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Elements ``[lo, hi)`` of a received tensor whose copies are each one run (``part_names``): for
    each copy they meet, (the first such element's offset from ``lo``, how many, their destination)."""
    for c in copies:
        a, b = max(lo, c.offset), min(hi, c.offset + c.dst.numel())
        if a < b:
            yield a - lo, b - a, c.dst.view(-1)[a - c.offset : b - c.offset]


def _one_run(copy: PlannedCopy) -> bool:
    """Whether ``copy`` reads consecutive elements (row-major) into a contiguous destination."""
    if not copy.dst.is_contiguous():
        return False
    expected = 1
    for size, stride in reversed(list(zip(copy.size, copy.stride))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class _Recorder(TorchDispatchMode):
    """Watches one loader call: the copies from received tensors into parameters, and anything else."""

    def __init__(self, received: list[tuple[str, torch.Tensor]], params: Iterable[torch.Tensor]) -> None:
        super().__init__()
        # received tensors by storage: [(first element, last element + 1, name, first element's offset)]
        self._received: dict[int, list[tuple[int, int, str]]] = {}
        for name, t in received:
            if t.numel() == 0:
                continue
            if not t.is_contiguous():
                raise ValueError(f"received tensor {name!r} is not contiguous")
            start = t.storage_offset()
            self._received.setdefault(t.untyped_storage().data_ptr(), []).append((start, start + t.numel(), name))
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self.recorded = Recorded({name: [] for name, _ in received}, {})
        self._last = received[0][0] if received else ""  # the tensor being loaded (fills go with it)
        self.problem: str | None = None

    def _origin(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(name, element offset within it) of the received tensor ``t`` views, or None."""
        spans = self._received.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        for start, end, name in spans or ():
            if start <= t.storage_offset() < end:
                return name, t.storage_offset() - start
        return None

    def _flag(self, why: str) -> None:
        if self.problem is None:
            self.problem = why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if func.is_view or name.startswith(_METADATA_OPS):
            return out
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if name == "aten::copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            if dst.numel() == 0:  # (a zero-element tensor's copy writes nothing)
                return out
            origin = self._origin(src)
            into_param = dst.untyped_storage().data_ptr() in self._params
            if origin is not None and into_param and src.shape == dst.shape:
                self.recorded.copies[origin[0]].append(PlannedCopy(origin[1], tuple(src.shape), tuple(src.stride()),
                                                                   dst))
                self._last = origin[0]
            elif origin is not None:
                self._flag(f"{origin[0]!r} copied into memory that is not a parameter's")
            elif into_param:
                self._flag(f"a parameter written from a tensor that is not a received one ({func})")
            return out
        if name in ("aten::fill_", "aten::zero_") and args[0].untyped_storage().data_ptr() in self._params:
            value = 0 if name == "aten::zero_" else args[1]
            if isinstance(value, torch.Tensor):
                self._flag(f"{func} fills a parameter from a tensor")
            elif args[0].numel():
                self.recorded.fills.setdefault(self._last, []).append((args[0], value))
            return out
        for t in tensors:
            if self._origin(t) is not None:
                self._flag(f"{func} computes on received tensor {self._origin(t)[0]!r}")
            elif func._schema.is_mutable and t.untyped_storage().data_ptr() in self._params:
                self._flag(f"{func} writes into a parameter")
        return out


def learn(load: Callable[[list[tuple[str, torch.Tensor]]], None], received: list[tuple[str, torch.Tensor]],
          params: Iterable[torch.Tensor]) -> tuple[Recorded | None, str | None]:
    """Call ``load(received)`` (the model's loader: it loads them, as always) and record what it did.

    Returns (what it did, None), or (None, why) when a replay would not do what the loader did.
    ``params``: the model's parameters and buffers, the only memory a plan may write.
    """
    recorder = _Recorder(received, params)
    with recorder:
        load(received)
    if recorder.problem is not None:
        return None, recorder.problem
    return recorder.recorded, None
