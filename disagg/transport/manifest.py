"""The weight manifest: what a sync moves and how it is laid out in buckets.

A manifest is the contract between the trainer (sender) and every receiver:
the tensors in send order, their shapes and dtypes, and the bucket plan that
says which element range of which tensor sits where in which flat bucket.
Planning is a pure function of the tensor specs and the bucket size, so both
sides can check they agree (``layout_digest``) before any byte moves.
``ManifestCache`` is how any process holds a manifest from one sync to the next.

This module must stay free of torch and grpc: it is imported by the control
plane, the planner tests and the CLI.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Sequence

# Bytes per element for the dtypes a manifest may carry (torch dtype names).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


# How much larger each bucket of a ramp may be than the one before (``plan_buckets``): on a GPU
# the sender packs (fp32 -> bf16) and a receiver copies at about three times NCCL's NVLink rate,
# so a bucket three times the size is ready, or loaded, while the one beside it is on the wire.
RAMP_GROWTH = 3


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as the receiver's model names it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @functools.cached_property
    def numel(self) -> int:  # cached: the receive loop asks for it per entry per sync
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class BucketEntry:
    """A contiguous element range of one tensor placed in a bucket.

    ``tensor_offset`` counts elements into the flattened tensor, ``bucket_offset``
    elements into the bucket. A tensor larger than a bucket is split into several
    entries in consecutive buckets.
    """

    name: str
    tensor_offset: int
    bucket_offset: int
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    """One flat buffer of a single dtype, sent in one broadcast."""

    index: int
    dtype: str
    numel: int
    entries: tuple[BucketEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """Everything a receiver needs to take one policy version off the wire."""

    policy_version: int
    bucket_bytes: int
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[BucketPlan, ...]
    total_bytes: int = field(default=0)
    first_bucket_bytes: int = 0  # the ramp's first bucket (``plan_buckets``); 0: no ramp

    @functools.cached_property
    def _digest(self) -> str:
        d = self.to_dict()
        d.pop("policy_version")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def layout_digest(self) -> str:
        """Hash of names, shapes, dtypes and bucket layout (not the version); computed once."""
        return self._digest

    def with_version(self, policy_version: int) -> "Manifest":
        """The same layout at another version. The digest is computed here once, on the manifest every
        version is made from, and carried over: hashing the layout costs about a millisecond for ~340
        tensors, on the critical path of every sync on each side."""
        m = Manifest(policy_version, self.bucket_bytes, self.tensors, self.buckets, self.total_bytes,
                     self.first_bucket_bytes)
        m.__dict__["_digest"] = self._digest
        return m

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "policy_version": self.policy_version,
            "bucket_bytes": self.bucket_bytes,
            "total_bytes": self.total_bytes,
            "first_bucket_bytes": self.first_bucket_bytes,
            "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors],
            "buckets": [
                [b.index, b.dtype, b.numel, [[e.name, e.tensor_offset, e.bucket_offset, e.numel] for e in b.entries]]
                for b in self.buckets
            ],
        }

    @staticmethod
    def from_dict(d: dict) -> "Manifest":
        return Manifest(
            policy_version=int(d["policy_version"]),
            bucket_bytes=int(d["bucket_bytes"]),
            total_bytes=int(d["total_bytes"]),
            first_bucket_bytes=int(d.get("first_bucket_bytes", 0)),
            tensors=tuple(TensorSpec(n, tuple(int(x) for x in s), dt) for n, s, dt in d["tensors"]),
            buckets=tuple(
                BucketPlan(int(i), dt, int(n), tuple(BucketEntry(en, int(to), int(bo), int(ne)) for en, to, bo, ne in ents))
                for i, dt, n, ents in d["buckets"]
            ),
        )


class ManifestCache:
    """A manifest held from one sync to the next, by its layout digest: the one rule of every
    process that keeps one (the driver's ``WeightSync``, the trainer's push, each engine actor,
    each engine's vLLM worker).

    A layout never changes under its digest, so the manifest held answers for any policy version
    (re-versioned by ``with_version``, its digest carried over, not hashed again): ``at`` for the
    holder whose own layout it is (the driver and the trainer; ``made_at`` makes it there at the first
    ask), ``by_digest`` for a receiver told
    only a digest, which answers only when that digest is the held one's. Otherwise nothing is
    answered here (None): the holder gets the manifest where it is made (the trainer plans it, the
    driver asks the trainer, an engine asks the coordinator, a worker refuses the update) and
    ``hold``s it, which replaces what was held. ``forget`` when the layout may change (the buckets
    re-planned)."""

    def __init__(self) -> None:
        self._manifest: Manifest | None = None

    @property
    def held(self) -> Manifest | None:
        """The manifest held, at the version it was held at (None: none)."""
        return self._manifest

    @property
    def digest(self) -> str | None:
        """The held manifest's layout digest (None: none held)."""
        return self._manifest.layout_digest() if self._manifest is not None else None

    def hold(self, manifest: Manifest) -> Manifest:
        """Hold ``manifest`` from now on, in place of any held; returns it."""
        self._manifest = manifest
        return manifest

    def holds(self, digest: str | None) -> bool:
        """Whether the held manifest's layout digest is ``digest`` (never for None)."""
        return digest is not None and self._manifest is not None and self._manifest.layout_digest() == digest

    def at(self, policy_version: int) -> Manifest | None:
        """The held manifest at ``policy_version`` (None: none held)."""
        return self._manifest.with_version(policy_version) if self._manifest is not None else None

    def made_at(self, policy_version: int, make: Callable[[], Manifest]) -> Manifest:
        """The held manifest at ``policy_version``, made by ``make`` and held first where none is (the
        holder whose own layout it is: the driver asks the trainer, the trainer plans it)."""
        if self._manifest is None:
            self.hold(make())
        return self._manifest.with_version(policy_version)

    def by_digest(self, digest: str | None, policy_version: int) -> Manifest | None:
        """The held manifest at ``policy_version`` when its layout digest is ``digest``; else None."""
        return self._manifest.with_version(policy_version) if self.holds(digest) else None

    def forget(self) -> None:
        """Hold nothing: the next sync gets its manifest where it is made."""
        self._manifest = None


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int, policy_version: int = 0,
                 first_bucket_bytes: int = 0) -> Manifest:
    """Lay tensors out in flat single-dtype buckets of at most ``bucket_bytes``.

    Tensors keep their order within a dtype; dtypes are laid out in order of first
    appearance. A tensor that fits in a bucket never straddles two: when it does
    not fit in the space left, the bucket is closed and the tensor starts the next
    one, so receivers get it as a view of the bucket (no reassembly copy). Only a
    tensor larger than a bucket is split, into consecutive full buckets starting
    with a fresh one (its last part may share a bucket with what follows). Pure.

    ``first_bucket_bytes`` (0: off): each dtype's buckets ramp up from it and back down to it, the
    size limit growing ``RAMP_GROWTH``-fold bucket by bucket up to ``bucket_bytes``, then shrinking
    as fast over the last buckets (each at most ``(RAMP_GROWTH - 1) / RAMP_GROWTH`` of what is left,
    never below the first's size). The sender packs a bucket before it goes on the wire and a
    receiver loads it after it arrived: with a small first and last bucket the wire starts sooner
    and the last load ends sooner, while a bucket's packing (or loading) still takes less time than
    the broadcast beside it. Within the ramps the size limit is the ramp's, so a tensor may be
    split there that a full bucket would hold.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"transport.bucket_bytes must be > 0, got {bucket_bytes}")
    if first_bucket_bytes < 0:
        raise ValueError(f"transport.first_bucket_bytes must be >= 0 (0: no ramp), got {first_bucket_bytes}")
    ramp = 0 < first_bucket_bytes < bucket_bytes
    seen: set[str] = set()
    by_dtype: dict[str, list[TensorSpec]] = {}
    for s in specs:
        if s.name in seen:
            raise ValueError(f"duplicate tensor name in manifest: {s.name!r}")
        if s.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported dtype {s.dtype!r} for tensor {s.name!r}")
        seen.add(s.name)
        by_dtype.setdefault(s.dtype, []).append(s)

    buckets: list[BucketPlan] = []
    for dtype, group in by_dtype.items():
        full = bucket_bytes // DTYPE_BYTES[dtype]
        if full == 0:
            raise ValueError(f"transport.bucket_bytes={bucket_bytes} is smaller than one {dtype} element")
        first = max(1, first_bucket_bytes // DTYPE_BYTES[dtype]) if ramp else full
        left = sum(s.numel for s in group)  # elements of this dtype not yet in a closed bucket
        opened = 0  # buckets of this dtype so far

        def limit() -> int:
            """The size limit of the bucket being filled: the ramp's up, then down, else full."""
            if not ramp:
                return full
            up = first * RAMP_GROWTH ** min(opened, 40)
            down = max(first, -(-left * (RAMP_GROWTH - 1) // RAMP_GROWTH))
            return min(full, up, down)

        entries: list[BucketEntry] = []
        fill = 0
        cap = limit()

        def close() -> None:
            nonlocal entries, fill, opened, left, cap
            if entries:
                buckets.append(BucketPlan(len(buckets), dtype, fill, tuple(entries)))
                opened, left = opened + 1, left - fill
            entries, fill = [], 0
            cap = limit()

        for s in group:
            if fill and s.numel > cap - fill:
                close()  # a fresh bucket: it then fits whole, or is split into full buckets
            done = 0
            while done < s.numel:
                take = min(s.numel - done, cap - fill)
                entries.append(BucketEntry(s.name, done, fill, take))
                fill += take
                done += take
                if fill == cap:
                    close()
        close()

    total = sum(s.nbytes for s in specs)
    return Manifest(policy_version, bucket_bytes, tuple(specs), tuple(buckets), total,
                    first_bucket_bytes if ramp else 0)


def layout_mismatch(sent: Sequence[TensorSpec], expected: Sequence[TensorSpec], limit: int = 5) -> list[str]:
    """How the tensors a sender announces disagree with a receiver model's (empty: they agree).

    Names and shapes must match exactly; dtypes only in kind (a floating tensor may be sent
    in another floating dtype, the receiver casts). At most ``limit`` problems, then a count.
    """
    want = {t.name: t for t in expected}
    got = {t.name: t for t in sent}
    problems = [f"{n!r} is not a parameter of the model" for n in got if n not in want]
    problems += [f"{n!r} {tuple(want[n].shape)} is missing" for n in want if n not in got]
    for n, t in got.items():
        w = want.get(n)
        if w is None:
            continue
        if tuple(t.shape) != tuple(w.shape):
            problems.append(f"{n!r} has shape {tuple(t.shape)}, the model's is {tuple(w.shape)}")
        elif _is_float(t.dtype) != _is_float(w.dtype):
            problems.append(f"{n!r} is {t.dtype}, the model's is {w.dtype}")
    if len(problems) > limit:
        problems = problems[:limit] + [f"... {len(problems) - limit} more"]
    return problems


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat")) or dtype in ("half", "double")
