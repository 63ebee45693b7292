"""Exact delta encoding of one bucket against the image the receivers hold.

Between two RL steps most bf16 values of a model do not change at all. A delta
sync sends, per bucket, only the elements whose bits differ from the previous
version's bucket, in the smallest of four forms:

- ``SAME``: nothing changed, nothing is sent;
- ``INDEX``: the changed positions (int32) then their new values;
- ``MASK``: one bit per element (little-endian within a byte) then the new values
  of the set bits, in position order;
- ``DENSE``: the whole bucket, where a delta would not be smaller.

Elements are compared by their raw bits, so the result is exact for every value
(``-0.0`` against ``0.0``, NaNs of any payload): ``apply`` onto the same base
gives back the new bucket bit for bit. A payload is one flat ``uint8`` buffer
(indices or mask first, padded to 4 bytes, then the values), so one broadcast
carries it whatever the bucket's dtype.

This module is pure tensor work (the same code on CPU and on GPU buffers): it
never communicates and never imports vLLM or Ray.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from disagg.transport.manifest import Manifest

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX_BYTES = 4  # int32 positions: a bucket holds fewer than 2**31 elements
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class Form(enum.IntEnum):
    """How one bucket of a delta sync goes on the wire."""

    SAME = 0
    INDEX = 1
    MASK = 2
    DENSE = 3


def _align(n: int) -> int:
    return (n + 3) // 4 * 4


def payload_bytes(form: Form, numel: int, changed: int, item: int) -> int:
    """Bytes on the wire for a bucket of ``numel`` elements of ``item`` bytes, ``changed`` of them new."""
    if form is Form.SAME:
        return 0
    if form is Form.INDEX:
        return _INDEX_BYTES * changed + item * changed
    if form is Form.MASK:
        return _align((numel + 7) // 8) + item * changed
    return item * numel


def choose_form(numel: int, changed: int, item: int) -> Form:
    """The form with the fewest bytes (dense on a tie: it needs no decoding)."""
    if changed == 0:
        return Form.SAME
    forms = (Form.DENSE, Form.INDEX, Form.MASK) if numel < 2**31 else (Form.DENSE, Form.MASK)  # int32 positions
    sizes = {f: payload_bytes(f, numel, changed, item) for f in forms}
    return min(sizes, key=lambda f: (sizes[f], f is not Form.DENSE))


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(_INT_VIEW[flat.element_size()])


def changed_mask(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Where the raw bits of ``new`` and ``base`` (1-D, same dtype and size) differ."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"delta of a {new.dtype} x {tuple(new.shape)} bucket against a base of "
                         f"{base.dtype} x {tuple(base.shape)}")
    return _bits(new) != _bits(base)


@dataclass(frozen=True)
class BucketDelta:
    """One encoded bucket: its form, how many elements changed, and the bytes to send."""

    form: Form
    numel: int
    changed: int
    payload: torch.Tensor | None  # uint8; None for SAME, and for DENSE (the bucket itself is sent)

    @property
    def nbytes(self) -> int:
        return 0 if self.payload is None else self.payload.numel()


def _pack_mask(mask: torch.Tensor) -> torch.Tensor:
    n = mask.numel()
    padded = torch.zeros(_align((n + 7) // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.to(torch.uint8)
    return (padded.view(-1, 8) * _BITS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    bits = packed.unsqueeze(1).bitwise_and(_BITS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:numel]


def encode(new: torch.Tensor, base: torch.Tensor, force_dense: bool = False) -> BucketDelta:
    """The delta that turns ``base`` into ``new`` (1-D buckets of one dtype), in its smallest form.

    One pass compares the two; one host read learns how many elements changed (the
    form depends on it). ``force_dense`` skips the comparison."""
    numel, item = new.numel(), new.element_size()
    if force_dense:
        return BucketDelta(Form.DENSE, numel, numel, None)
    mask = changed_mask(new, base)
    changed = int(mask.count_nonzero())  # (a bool sum is 20x slower on CPU)
    form = choose_form(numel, changed, item)
    if form in (Form.SAME, Form.DENSE):
        return BucketDelta(form, numel, changed, None)
    if form is Form.INDEX:
        at = mask.nonzero().reshape(-1)
        where, values = at.to(torch.int32).view(torch.uint8), new.index_select(0, at).view(torch.uint8)
    else:
        where, values = _pack_mask(mask), new[mask].view(torch.uint8)
    return BucketDelta(form, numel, changed, torch.cat([where, values]))


def mark(new: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``new`` differs from ``base``, as packed bits (``MASK``'s layout), and how many: both on
    the device, no host read. With ``encode_marked`` the encoding of ``encode`` in two passes, so a
    sender reads every bucket's count at once instead of one bucket at a time."""
    changed = changed_mask(new, base)
    return _pack_mask(changed), changed.sum(dtype=torch.int64)


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    try:
        return torch.nonzero_static(mask, size=count).reshape(-1)  # the size known: no host read
    except (AttributeError, NotImplementedError, RuntimeError):  # a torch or device without it
        return mask.nonzero().reshape(-1)


def encode_marked(new: torch.Tensor, marks: torch.Tensor, changed: int) -> BucketDelta:
    """``encode``'s delta of the bucket ``new`` from ``mark``'s bits and count (the base may since
    hold ``new``): the same form and payload, without a host read."""
    numel, item = new.numel(), new.element_size()
    form = choose_form(numel, changed, item)
    if form in (Form.SAME, Form.DENSE):
        return BucketDelta(form, numel, changed, None)
    at = _positions(_unpack_mask(marks, numel), changed)
    where = at.to(torch.int32).view(torch.uint8) if form is Form.INDEX else marks
    return BucketDelta(form, numel, changed, torch.cat([where, new.index_select(0, at).view(torch.uint8)]))


def estimate(new: torch.Tensor, base: torch.Tensor, total_numel: int, marked: bool = False) -> tuple[float, float]:
    """What a delta of a whole model would cost to encode, from encoding one of its buckets: the
    seconds ``encode(new, base)`` took (``marked``: ``mark`` then ``encode_marked``, as a sender
    with ``one_read`` does) scaled to ``total_numel`` elements, and the share of the bucket's bytes
    the delta would send (``base`` is left as it was)."""
    def synced() -> float:
        if new.device.type == "cuda":
            torch.cuda.synchronize(new.device)
        return time.perf_counter()

    t0 = synced()
    if marked:
        bits, count = mark(new, base)
        d = encode_marked(new, bits, int(count))
    else:
        d = encode(new, base)
    seconds = synced() - t0
    sent = new.numel() * new.element_size() if d.form is Form.DENSE else d.nbytes
    return seconds * total_numel / max(1, new.numel()), sent / max(1, new.numel() * new.element_size())


def apply(base: torch.Tensor, form: Form, changed: int, payload: torch.Tensor | None) -> None:
    """Turn ``base`` (1-D) into the new bucket in place, from a payload ``encode`` made against it.

    ``DENSE`` payloads are the new bucket itself (of ``base``'s dtype); the others are ``uint8``."""
    numel, item = base.numel(), base.element_size()
    if form is Form.SAME:
        return
    want = payload_bytes(form, numel, changed, item)
    got = 0 if payload is None else payload.numel() * payload.element_size()
    if got != want:
        raise ValueError(f"{form.name} payload of {got} bytes for a bucket of {numel} elements with {changed} "
                         f"changed: expected {want}")
    if form is Form.DENSE:
        base.copy_(payload.view(base.dtype))
        return
    if form is Form.INDEX:
        split = _INDEX_BYTES * changed
        where = payload[:split].view(torch.int32).to(torch.int64)
        base.index_copy_(0, where, payload[split:].view(base.dtype))
        return
    split = _align((numel + 7) // 8)
    mask = _unpack_mask(payload[:split], numel)
    base.masked_scatter_(mask, payload[split:].view(base.dtype))


class DeltaImage:
    """The buckets of the version a delta sync's receivers hold, in wire layout: what the sender
    diffs against and what each receiver applies onto (one flat buffer per dtype, every bucket a
    slice of it). ``version`` is the policy version it holds, None while it holds none (never
    filled, a sync into it failed half-way, or the caller invalidated it): the next sync is then dense.

    It costs one copy of the weights in the wire dtype on its device."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.version: int | None = None
        self._layout: str | None = None
        self._buckets: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buckets)

    def holds(self, manifest: Manifest, version: int) -> bool:
        """Whether it holds exactly ``version`` in the layout of ``manifest``."""
        return self.version == version and self._layout == manifest.layout_digest()

    def buckets(self, manifest: Manifest) -> list[torch.Tensor]:
        """Bucket ``i`` of ``manifest`` as a 1-D view; a new layout gets fresh (zeroed) buffers and no version."""
        digest = manifest.layout_digest()
        if digest != self._layout:
            self.version, self._layout, self._buckets = None, None, []
            sizes: dict[str, int] = {}
            for plan in manifest.buckets:
                sizes[plan.dtype] = sizes.get(plan.dtype, 0) + plan.numel
            flats = {dt: torch.zeros(n, dtype=getattr(torch, dt), device=self.device) for dt, n in sizes.items()}
            offsets = dict.fromkeys(sizes, 0)
            for plan in manifest.buckets:
                at = offsets[plan.dtype]
                self._buckets.append(flats[plan.dtype][at : at + plan.numel])
                offsets[plan.dtype] = at + plan.numel
            self._layout = digest
        return self._buckets

    def invalidate(self) -> None:
        """Hold no version: the next sync through it is dense."""
        self.version = None


class DeltaChooser:
    """``transport.delta=auto``: whether the next sync of one sender goes as a delta or dense, from
    what its syncs took. The model's bytes are the same every sync, so a dense sync's seconds and
    a delta's compare as they are. Dense first (nothing is held yet, and it measures the dense
    time); then a dense sync that also times encoding one bucket as a delta (``wants_estimate``:
    ``WeightSender.send_delta(estimate=True)``), from which a whole delta's cost is predicted; a
    delta is tried only where that prediction beats dense, so a link where a delta cannot win
    (NVLink, loopback) never sends one. Then whichever was faster last, but dense while a delta
    saves less than a tenth of the bytes. After ``probe_every`` syncs in a row of one kind the
    other is tried again (a delta only while predicted to win): the share of values that change
    drifts as training goes on, and a first sync's time carries its set-up. A retry that loses
    doubles the wait before the next one (up to ``max_probe_every``), so the retries' cost fades
    over a run; a retry that wins starts the waits over. A sender that gives no estimate gets a
    delta to measure instead."""

    MAX_SHARE = 0.9  # of the dense bytes: a delta sending more saves too little to pay for its comparison

    def __init__(self, probe_every: int = 8, max_probe_every: int = 512) -> None:
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.wait = probe_every  # syncs in a row of one kind before the other is tried again
        self.dense_s: float | None = None
        self.delta_s: float | None = None
        self.delta_share = 1.0  # the last delta's bytes on the wire, of the dense bytes
        self.encode_s: float | None = None  # predicted: a whole delta's encoding (``estimate``)
        self.estimating = False  # the sync being chosen is to give an estimate (``send_delta(estimate=True)``)
        self.estimate_tried = False
        self.last_delta: bool | None = None
        self.in_row = 0

    @property
    def wants_estimate(self) -> bool:
        """The next sync (dense) should time one bucket's encoding: nothing predicts a delta yet."""
        return self.dense_s is not None and self.delta_s is None and self.encode_s is None and not self.estimate_tried

    def _delta_faster(self) -> bool:
        return self.delta_share < self.MAX_SHARE and self.delta_s < self.dense_s

    def _delta_hopeless(self) -> bool:
        """Predicted to lose: its encoding plus its bytes at the dense rate take longer than dense."""
        return self.encode_s is not None and self.encode_s + self.delta_share * self.dense_s >= self.dense_s

    def delta_next(self) -> bool:
        if self.dense_s is None:
            return False
        if self.delta_s is None:
            if self.wants_estimate:
                self.estimating = True
                return False
            return not self._delta_hopeless()
        if self.in_row >= self.wait:
            return not self.last_delta and not self._delta_hopeless()
        return self._delta_faster()

    def amend(self, seconds: float) -> None:
        """The last sync took ``seconds`` end to end (the driver's announce -> every engine serving):
        its kind is weighed by that from now on, not by what its sender measured, which leaves out
        the receivers' applying and loading."""
        if self.last_delta is None:
            return
        if self.last_delta:
            self._delta_took(seconds, self.delta_share)
        else:
            self.dense_s = seconds

    def _delta_took(self, seconds: float, share: float) -> None:
        """A delta sending ``share`` of the dense bytes took ``seconds``: the measurement replaces the
        prediction of its encoding (what it took beyond its bytes at the dense rate)."""
        self.delta_s, self.delta_share = seconds, share
        if self.dense_s is not None:
            self.encode_s = max(0.0, seconds - share * self.dense_s)

    def record(self, delta: bool, seconds: float, share: float = 1.0,
               estimate: tuple[float, float] | None = None) -> None:
        """A sync went out (``delta``: as a delta, sending ``share`` of the dense bytes) and took
        ``seconds`` on the sender; ``estimate``: (seconds, share) of ``delta.estimate`` it made."""
        retry = self.in_row >= self.wait and delta != self.last_delta
        self.estimate_tried |= self.estimating
        self.estimating = False
        if delta:
            self._delta_took(seconds, share)
        else:
            self.dense_s = seconds
        if estimate is not None:
            self.encode_s = estimate[0]
            if self.delta_s is None:
                self.delta_share = estimate[1]
        if retry and self.delta_s is not None and self.dense_s is not None:
            won = self._delta_faster() == delta
            self.wait = self.probe_every if won else min(2 * self.wait, self.max_probe_every)
        self.in_row = self.in_row + 1 if delta == self.last_delta else 1
        self.last_delta = delta
