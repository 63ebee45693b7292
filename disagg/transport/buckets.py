"""Packing tensors into flat buckets and taking them back out.

Every sender and every receiver uses these two pieces, so the byte layout a
manifest describes is implemented exactly once: ``pack_bucket`` copies each
entry's element range into a flat buffer, ``Reassembler`` turns received
buffers back into named tensors of the manifest's shapes.

This module must never communicate or import vLLM or Ray: it is pure tensor
work, tested on CPU, and the same code runs on GPU buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from disagg.errors import TransportError
from disagg.transport.manifest import BucketPlan, Manifest, TensorSpec


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest dtype name such as ``"bfloat16"``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def bucket_buffers(manifest: Manifest, device: torch.device, slack: int = 0) -> dict[str, torch.Tensor]:
    """One flat buffer per dtype, as large as that dtype's largest bucket (plus ``slack`` elements).

    One such set is one pipeline slot: every bucket of a dtype that goes through
    the slot reuses the same buffer (sliced to its size).
    """
    sizes: dict[str, int] = {}
    for plan in manifest.buckets:
        sizes[plan.dtype] = max(sizes.get(plan.dtype, 0), plan.numel + slack)
    return {dt: torch.empty(n, dtype=torch_dtype(dt), device=device) for dt, n in sizes.items()}


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bucket_checksum(buf: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the raw bits of ``buf``: plain and position-weighted.

    The weighted sum catches swapped elements as well as flipped bits. Computed
    on the buffer's device in chunks, so it costs one pass and a small temporary.
    """
    flat = buf.reshape(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=buf.device)
    step = 1 << 24
    for start in range(0, bits.numel(), step):
        chunk = bits[start : start + step].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=buf.device, dtype=torch.int64) % 65521 + 1
        total[0] += chunk.sum()
        total[1] += (chunk * weights).sum()
    return total


def pack_bucket(
    plan: BucketPlan, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy the element ranges ``plan`` names into one flat tensor of the plan's dtype.

    ``tensors`` must hold every tensor the plan has an entry for (others are
    ignored). Sources are read flattened in row-major order; a source whose dtype
    differs from the plan's is cast during the copy. ``out``, when given, is a 1-D
    buffer of the plan's dtype with at least ``plan.numel`` elements; the result is
    its first ``plan.numel`` elements. Without ``out`` the bucket is allocated on
    the device of the first source tensor.
    """
    dtype = torch_dtype(plan.dtype)
    if out is None:
        first = tensors[plan.entries[0].name] if plan.entries else None
        device = first.device if first is not None else torch.device("cpu")
        out = torch.empty(plan.numel, dtype=dtype, device=device)
    if out.dim() != 1 or out.dtype != dtype or out.numel() < plan.numel:
        raise ValueError(
            f"bucket {plan.index}: out buffer must be 1-D {plan.dtype} with >= {plan.numel} elements, "
            f"got shape {tuple(out.shape)} {dtype_name(out.dtype)}"
        )
    flat_out = out[: plan.numel]
    for e in plan.entries:
        if e.name not in tensors:
            raise KeyError(f"bucket {plan.index} needs tensor {e.name!r}, which was not provided")
        src = tensors[e.name].reshape(-1)
        if e.tensor_offset + e.numel > src.numel():
            raise ValueError(
                f"bucket {plan.index}: tensor {e.name!r} has {src.numel()} elements, the plan reads "
                f"[{e.tensor_offset}, {e.tensor_offset + e.numel})"
            )
        flat_out[e.bucket_offset : e.bucket_offset + e.numel].copy_(
            src[e.tensor_offset : e.tensor_offset + e.numel]
        )
    return flat_out


def contiguous_bucket(plan: BucketPlan, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The bucket as a view of existing memory, if its sources already lie there in plan order.

    True when the sources are slices of one flat storage laid out exactly as the
    plan packs them (parameters kept in a flat buffer, see ``flatten_parameters``):
    the bucket is then sent straight from the parameters, with no packing copy.
    """
    dtype = torch_dtype(plan.dtype)
    if not plan.entries:
        return None
    first = tensors[plan.entries[0].name]
    if first.dtype != dtype or not first.is_contiguous():
        return None
    item = first.element_size()
    storage = first.untyped_storage()
    base = first.data_ptr() + plan.entries[0].tensor_offset * item
    for e in plan.entries:
        t = tensors[e.name]
        if (t.dtype != dtype or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.data_ptr() + e.tensor_offset * item != base + e.bucket_offset * item):
            return None
    offset = (base - storage.data_ptr()) // item
    return torch.empty(0, dtype=dtype, device=first.device).set_(storage, offset, (plan.numel,))


def flatten_parameters(module: torch.nn.Module, order: list[str] | None = None) -> dict[torch.dtype, torch.Tensor]:
    """Move ``module``'s parameters into one flat buffer per dtype (each parameter a view of it).

    In ``order`` (default: ``named_parameters`` order), which should be the
    manifest's, so that every bucket of a sync is a slice of a flat buffer and is
    sent without a packing copy. Not for FSDP-sharded modules. Returns the buffers.
    """
    params = dict(module.named_parameters())
    names = order or list(params)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n in names:
        by_dtype.setdefault(params[n].dtype, []).append(n)
    flats = {}
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            total = sum(params[n].numel() for n in group)
            flat = torch.empty(total, dtype=dtype, device=params[group[0]].device)
            off = 0
            for n in group:
                p = params[n]
                flat[off : off + p.numel()].copy_(p.data.reshape(-1))
                p.data = flat[off : off + p.numel()].view(p.shape)
                off += p.numel()
            flats[dtype] = flat
    return flats


_SPEC_INDEX: dict[str, dict[str, TensorSpec]] = {}


def _spec_index(manifest: Manifest) -> dict[str, TensorSpec]:
    """Name -> spec of a manifest whose buckets cover every tensor exactly; checked once per layout.

    Raises ``ValueError`` for a bucket naming an unknown tensor or another dtype, or a
    tensor its buckets do not cover exactly. The result depends on the layout alone
    (the digest), so it is kept for the next sync of the same layout.
    """
    digest = manifest.layout_digest()
    index = _SPEC_INDEX.get(digest)
    if index is not None:
        return index
    index = {t.name: t for t in manifest.tensors}
    covered: dict[str, int] = {}
    for plan in manifest.buckets:
        for e in plan.entries:
            spec = index.get(e.name)
            if spec is None:
                raise ValueError(f"bucket {plan.index} names tensor {e.name!r}, absent from the manifest")
            if spec.dtype != plan.dtype:
                raise ValueError(f"bucket {plan.index} is {plan.dtype} but {e.name!r} is {spec.dtype}")
            covered[e.name] = covered.get(e.name, 0) + e.numel
    for spec in manifest.tensors:
        if covered.get(spec.name, 0) != spec.numel:
            raise ValueError(
                f"manifest buckets cover {covered.get(spec.name, 0)} of the {spec.numel} elements of {spec.name!r}"
            )
    if len(_SPEC_INDEX) >= 8:  # a process sees few layouts; keep the newest
        _SPEC_INDEX.pop(next(iter(_SPEC_INDEX)))
    _SPEC_INDEX[digest] = index
    return index


@dataclass(frozen=True)
class PartLoader:
    """Takes the parts of the tensors ``names`` that are split over buckets, one at a time:
    ``load(name, part, element offset in the tensor, last part)``, where ``part`` is a 1-D view of
    a receive buffer, valid until the load returns (stream-ordered on GPUs)."""

    names: frozenset[str]
    load: Callable[[str, torch.Tensor, int, bool], None]
    # A whole received bucket at once, where the loader can (``copyplan.BucketReplay.load``):
    # ``bucket(plan, buffer)`` loads every tensor and part the bucket holds and returns how many
    # tensors it completed, or None to have the bucket reassembled (its tensors to ``load_fn``,
    # its parts to ``load``). It takes every bucket of a layout or none.
    bucket: Callable[[BucketPlan, torch.Tensor], int | None] | None = None


class Reassembler:
    """Turns received buckets back into the manifest's named tensors.

    ``feed`` returns the tensors a bucket completes, shaped as the manifest says.
    A tensor that lies wholly in one bucket is returned as a view into that
    bucket's buffer (no copy): it is valid only until the buffer is reused, so the
    caller must load it before receiving the next bucket into the same buffer. A
    tensor split over several buckets is assembled in a fresh tensor and returned
    with its last part, unless ``parts`` takes it: then each part goes to
    ``parts.load`` as it arrives (a view of the buffer, with its element offset in
    the tensor) and the tensor is never assembled. Zero-element tensors occupy no
    bucket; they are returned with the first bucket fed, or by ``finish`` when the
    manifest has no buckets.
    """

    def __init__(self, manifest: Manifest, device: torch.device | None = None,
                 parts: PartLoader | None = None) -> None:
        self._manifest = manifest
        self._device = device
        self._parts = parts
        self._specs: dict[str, TensorSpec] = _spec_index(manifest)
        self._empty = [t for t in manifest.tensors if t.numel == 0]
        self._partial: dict[str, torch.Tensor] = {}
        self._received: dict[str, int] = {}
        self._fed: set[int] = set()

    def feed(self, plan: BucketPlan, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Take one received bucket; return the tensors it completes, in entry order."""
        if plan.index in self._fed:
            raise ValueError(f"bucket {plan.index} was fed twice")
        if buf.dtype != torch_dtype(plan.dtype) or buf.numel() < plan.numel:
            raise ValueError(
                f"bucket {plan.index}: buffer is {dtype_name(buf.dtype)} x {buf.numel()}, "
                f"the plan needs {plan.dtype} x {plan.numel}"
            )
        self._fed.add(plan.index)
        flat = buf.reshape(-1)
        completed: list[tuple[str, torch.Tensor]] = []
        if self._empty:
            completed.extend(self._take_empty(self._device or buf.device))
        for e in plan.entries:
            spec = self._specs[e.name]
            part = flat[e.bucket_offset : e.bucket_offset + e.numel]
            if e.numel == spec.numel:
                completed.append((e.name, part.view(spec.shape)))
                continue
            if self._parts is not None and e.name in self._parts.names:
                self._received[e.name] = self._received.get(e.name, 0) + e.numel
                last = self._received[e.name] == spec.numel
                self._parts.load(e.name, part, e.tensor_offset, last)
                if last:
                    del self._received[e.name]
                continue
            whole = self._partial.get(e.name)
            if whole is None:
                whole = torch.empty(spec.numel, dtype=buf.dtype, device=buf.device)
                self._partial[e.name] = whole
            whole[e.tensor_offset : e.tensor_offset + e.numel].copy_(part)
            self._received[e.name] = self._received.get(e.name, 0) + e.numel
            if self._received[e.name] == spec.numel:
                completed.append((e.name, self._partial.pop(e.name).view(spec.shape)))
                del self._received[e.name]
        return completed

    def skip(self, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
        """Count bucket ``plan`` as received where the caller loaded it whole (``PartLoader.bucket``);
        return the zero-element tensors, which come with the first bucket fed. A layout's buckets
        all go through ``feed`` or all through this: a tensor split over buckets is not followed
        from one to the other."""
        if plan.index in self._fed:
            raise ValueError(f"bucket {plan.index} was fed twice")
        self._fed.add(plan.index)
        return self._take_empty(self._device or torch.device("cpu")) if self._empty else []

    def finish(self) -> list[tuple[str, torch.Tensor]]:
        """Check every tensor was completed; return zero-element tensors not yet emitted.

        Raises ``TransportError`` naming the buckets not fed and the tensors not
        completed. The returned list is empty unless the manifest has no buckets.
        """
        missing_buckets = [p.index for p in self._manifest.buckets if p.index not in self._fed]
        if missing_buckets:
            missing = {e.name for p in self._manifest.buckets if p.index not in self._fed for e in p.entries}
            incomplete = [t.name for t in self._manifest.tensors if t.name in missing]
            raise TransportError(
                f"weight sync for policy_version={self._manifest.policy_version} is incomplete: "
                f"{len(missing_buckets)} of {len(self._manifest.buckets)} buckets not received "
                f"(first {missing_buckets[:5]}), {len(incomplete)} tensors incomplete (first {incomplete[:5]})"
            )
        return self._take_empty(self._device or torch.device("cpu"))

    def _take_empty(self, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        out = [(t.name, torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device)) for t in self._empty]
        self._empty = []
        return out
