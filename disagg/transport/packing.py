"""How one bucket of a send is made from the trainer's tensors: pulled from a mapping or a lazy
iterator (``TensorSource``), written by a ``BucketFill`` (a gather of FSDP shards), or copied into a
buffer slot, cast included (``Packer``).

Pure tensor work on the sender's device: this module never communicates and never imports vLLM or Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from disagg.transport.buckets import contiguous_bucket, pack_bucket
from disagg.transport.manifest import BucketPlan, Manifest

_VIEW_SETS = 4  # bucket-view sets a sender keeps (one per set of tensor addresses)

NamedTensors = Mapping[str, torch.Tensor] | Callable[[], Iterable[tuple[str, torch.Tensor]]]


def kept(cache: dict, key: tuple, build: Callable[[], Any]) -> Any:
    """``cache[key]``, built on a miss; the cache keeps the ``_VIEW_SETS`` newest keys."""
    if key not in cache:
        if len(cache) >= _VIEW_SETS:
            cache.pop(next(iter(cache)))
        cache[key] = build()
    return cache[key]


class BucketFill:
    """Writes one bucket's elements into a buffer: ``fill(plan, buf)``.

    ``slack`` is how many elements past ``plan.numel`` it may write (scratch space
    a gather needs); every buffer handed to it is that much longer.
    """

    slack: int = 0

    def __call__(self, plan: BucketPlan, buf: torch.Tensor) -> None:
        raise NotImplementedError


class TensorSource:
    """Hands out the tensors each bucket needs, pulling lazily from an iterator.

    Tensors are kept only until the last bucket that reads them has been sent.
    With an iterator, a tensor that arrives before it is needed (another dtype's
    buckets come first) is held until then.
    """

    def __init__(self, manifest: Manifest, named_tensors: NamedTensors) -> None:
        self._specs = {t.name: t for t in manifest.tensors}
        self._last_use: dict[str, int] = {}
        for plan in manifest.buckets:
            for e in plan.entries:
                self._last_use[e.name] = plan.index
        self._held: dict[str, torch.Tensor] = {}
        self._iter: Iterator[tuple[str, torch.Tensor]] | None = None
        if isinstance(named_tensors, Mapping):
            for name in self._last_use:
                if name not in named_tensors:
                    raise ValueError(f"tensor {name!r} is in the manifest but not in the tensors to send")
                self._held[name] = self._checked(name, named_tensors[name])
        else:
            self._iter = iter(named_tensors())

    def take(self, plan: BucketPlan) -> dict[str, torch.Tensor]:
        for e in plan.entries:
            while e.name not in self._held:
                self._pull(e.name)
        return {e.name: self._held[e.name] for e in plan.entries}

    def release(self, plan: BucketPlan) -> None:
        for e in plan.entries:
            if self._last_use[e.name] == plan.index:
                self._held.pop(e.name, None)

    def _pull(self, wanted: str) -> None:
        assert self._iter is not None
        for name, tensor in self._iter:
            if name in self._last_use:
                self._held[name] = self._checked(name, tensor)
                return
            if name not in self._specs:
                raise ValueError(f"tensor {name!r} is not in the manifest")
        raise ValueError(f"tensor {wanted!r} is in the manifest but was never produced by named_tensors")

    def _checked(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        spec = self._specs[name]
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the manifest says {spec.shape}")
        # One copy here, not one per bucket when a non-contiguous tensor is split.
        return tensor.contiguous()


class Packer:
    """``pack(i)``: bucket ``i`` of one send, ready for the wire. Unless ``slotted`` is false (every
    bucket a view of the parameters), it is packed into buffer slot ``i % len(slots)``, which the
    caller must not hand to a bucket still on the wire."""

    def __init__(self, manifest: Manifest, views: list[torch.Tensor] | None, slots: list[dict[str, torch.Tensor]],
                 fill: BucketFill | None, packs: list | None, source: TensorSource | None, zero_copy: bool) -> None:
        self.buckets, self.views, self.slots, self.fill = manifest.buckets, views, slots, fill
        self.packs, self.source, self.zero_copy = packs, source, zero_copy
        self.slotted = views is None

    def __call__(self, i: int) -> torch.Tensor:
        plan = self.buckets[i]
        if self.views is not None:  # straight from the parameters: no buffer to recycle
            return self.views[i]
        buf = self.slots[i % len(self.slots)][plan.dtype]
        if self.fill is not None:
            self.fill(plan, buf)
            return buf[: plan.numel]
        if self.packs is not None:
            torch._foreach_copy_(*self.packs[i])
            return buf[: plan.numel]
        tensors = self.source.take(plan)
        packed = contiguous_bucket(plan, tensors) if self.zero_copy else None
        if packed is None:
            packed = pack_bucket(plan, tensors, out=buf)
        self.source.release(plan)  # a view keeps what it reads alive; the rest was copied
        return packed
