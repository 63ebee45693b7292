"""The trainer's side of a weight sync: plan the manifest, broadcast the buckets.

The sender is rank ``src`` of a ``TransportGroup``. Before the buckets it
broadcasts a header (``wire.py``: policy version, bucket count, checksum of the
layout digest) so that a receiver holding a different manifest raises
``TransportError`` instead of loading garbage. The sender itself cannot see that
mismatch: it only sees the receiver leave, as a failed broadcast.

One send loop (``WeightSender._send``) sends a dense version and a delta alike: set up, the
driver's word, the header, the buckets in order. What differs, what the header says and what each
bucket sends, is its way (``_Dense``, ``_Delta``).

This module must never gather sharded (FSDP/DTensor) weights itself: the trainer
hands it full tensors. It never imports vLLM or Ray.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from disagg import faults
from disagg.transport.buckets import bucket_buffers, bucket_checksum, contiguous_bucket, dtype_name, torch_dtype
from disagg.transport.delta import BucketDelta, DeltaImage, Form, choose_form, encode, encode_marked, mark
from disagg.transport.delta import estimate as estimate_delta
from disagg.transport.group import TransportGroup
from disagg.transport.manifest import DTYPE_BYTES, Manifest, TensorSpec, plan_buckets
from disagg.transport.packing import BucketFill, NamedTensors, Packer, TensorSource, kept
from disagg.transport.wire import delta_header, header_for, ints_on, table_for

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SendStats:
    bytes: int  # payload bytes broadcast (the manifest's total_bytes)
    seconds: float  # wall time of the whole send, header included
    num_buckets: int
    header_unix_s: float = 0.0  # unix time the header's broadcast was posted (the send's set-up done)
    dense_bytes: int = 0  # what the version weighs (== bytes unless sent as a delta)
    delta_base: int = 0  # the version a delta was made against; 0: dense
    changed_fraction: float | None = None  # of the elements, against delta_base (None: dense, not compared)
    encode_s: float = 0.0  # of seconds, a delta's packing and comparing before its first byte left
    estimate: tuple[float, float] | None = None  # a dense sync's ``delta.estimate`` (send_delta(estimate=True))
    stamps: dict[str, float] = field(default_factory=dict)
    """Unix clock readings of the send's steps (``sync_timeline``'s ``trainer_*`` events): ``send`` (the
    sender entered), ``planned`` (its buckets' packing planned), ``header_copied`` (the header on the
    device, its broadcast next), ``early_packed`` (an armed push's first buckets packed as the train
    step ended, ``EarlyPack``), ``first`` (the first bucket's broadcast posted)."""
    early_buckets: int = 0  # buckets packed before the driver's word (EarlyPack), sent without packing


class EarlyPack:
    """An armed push's first buckets, packed the moment the parameters they hold are final.

    An armed push is set up while the step that makes its version trains, and then waits for the
    driver's word; its first bucket's packing (a 1 GiB bucket's fp32 -> bf16 cast: ~0.8 ms on an
    H200) would come after the word, before any byte can leave. The push ``offer``s how to pack its
    first buckets (one per buffer); the trainer calls ``params_final`` as the step ends (in the
    step's thread, so the copies queue behind the optimizer's kernels on the same stream); the push
    ``take``s what was packed once the word came. Whichever comes first wins: a word before the
    step's end, or a step that ended before the offer, leaves the push to pack as usual. ``take``
    (and a push called off) closes it: a step ending later packs nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._make: Callable[[], list] | None = None
        self._made: list | None = None
        self._closed = False
        self.packed_unix_s = 0.0

    def offer(self, make: Callable[[], list]) -> None:
        """``make()``: the first buckets packed, each ``(bucket, checksum or None)``."""
        with self._lock:
            if not self._closed:
                self._make = make

    def params_final(self) -> bool:
        """The parameters hold the version now: pack its first buckets if a push offered to. Whether it did."""
        with self._lock:
            if self._make is None or self._closed or self._made is not None:
                return False
            try:
                self._made = self._make()
            except Exception as e:  # noqa: BLE001 - the push packs them itself at the word (and names the error)
                log.warning("packing an armed push's first buckets early failed (packed at the word): %s", e)
                return False
            self.packed_unix_s = time.time()
            return True

    def take(self) -> list:
        """What was packed early (``[]``: nothing), and close: a later ``params_final`` packs nothing."""
        with self._lock:
            self._closed = True
            made, self._made, self._make = self._made or [], None, None
            return made


def build_manifest(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    policy_version: int,
    dtype_override: str | None = None,
    first_bucket_bytes: int = 0,
) -> Manifest:
    """Plan a manifest from names, shapes and dtypes (no data is read).

    A DTensor contributes its global shape. ``dtype_override`` (e.g. ``"bfloat16"``)
    applies to floating-point tensors only; integer and bool buffers keep theirs.
    ``first_bucket_bytes``: the buckets' ramp (``plan_buckets``; 0: none).
    """
    if dtype_override is not None and not (
        dtype_override in DTYPE_BYTES and torch_dtype(dtype_override).is_floating_point
    ):
        raise ValueError(f"transport.dtype_override must be a floating dtype name, got {dtype_override!r}")
    specs = []
    for name, t in named_tensors:
        dtype = dtype_override if dtype_override and t.dtype.is_floating_point else dtype_name(t.dtype)
        specs.append(TensorSpec(name, tuple(int(d) for d in t.shape), dtype))
    return plan_buckets(specs, bucket_bytes, policy_version, first_bucket_bytes)


class WeightSender:
    """Broadcasts one policy version's buckets from rank ``src`` of ``group``.

    Pipelined over ``num_buffers`` bucket buffers: while bucket i is on the wire,
    bucket i+1 is packed (and, through a lazy tensor source, gathered) into the
    next buffer; a buffer is reused only after its broadcast completed. A bucket
    whose tensors already lie in one flat buffer in plan order (see
    ``flatten_parameters``) is sent as a view, without packing. With ``verify``
    each bucket is followed by its checksum.

    Buckets are packed on ``device``, the device of the tensors it sends (default: the
    group's). Over gloo from GPU parameters (a trainer sharing its GPU with an engine,
    ``cluster=one_gpu``) the cast and the gather of each bucket then stay on the GPU and
    gloo copies the packed bucket to host memory in one piece through pinned memory,
    instead of a copy per tensor into pageable host buffers.
    """

    def __init__(self, group: TransportGroup, src: int = 0, num_buffers: int = 2, verify: bool = False,
                 device: torch.device | None = None, one_read: bool | None = None) -> None:
        if group.rank != src:
            raise ValueError(f"WeightSender must run on the source rank {src}, this is rank {group.rank}")
        if num_buffers < 1:
            raise ValueError(f"transport.num_buffers must be >= 1, got {num_buffers}")
        self.group = group
        self.src = src
        self.num_buffers = num_buffers
        self.verify = verify
        self.device = device if device is not None else group.device
        # How a delta's buckets are compared: one at a time, each with a host read of its changed
        # count (the default), or ``one_read``: all marked first, their counts read at once, each
        # encoded from its bits as it goes out. One read was meant to spare the GPUs a stall per
        # bucket, but its extra pass over the bits costs more: on 2 x H200 (1.5B, 49 buckets,
        # 2026-11-27) the trainer's delta send took 47-59 ms with it and 31-33 ms without.
        self.one_read = bool(one_read)
        self._after_pack: Callable[[int, torch.Tensor], None] | None = None  # fault injection in tests
        self._stream: torch.cuda.Stream | None = None  # a header's posted before the word (_header_stream)
        self._slots: list[dict[str, torch.Tensor]] = []
        self._slots_key: str | None = None
        # Bucket views of tensors that already lie in plan order (flat parameters), kept
        # across syncs while the layout and every tensor's address stay the same; a few
        # sets, as the trainer's weight snapshots alternate between buffers.
        self._views: dict[tuple, list[torch.Tensor] | None] = {}
        # Otherwise each bucket's packing copies as two lists of views (bucket slices, tensor
        # slices), kept the same way: a bucket is packed, cast included, by one fused call.
        self._packs: dict[tuple, list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None] = {}

    def _header_stream(self):
        """Where a header that goes out before the driver's word (``send(header_first=True)``) is copied
        and posted: on a GPU, a stream of its own, so that neither waits for the kernels of the train
        step queued meanwhile."""
        if self.group.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.group.device)
        return torch.cuda.stream(self._stream)

    def _addresses(self, manifest: Manifest, named_tensors: NamedTensors) -> tuple | None:
        """(the layout's digest, every tensor's address in manifest order): what the cached views of
        ``_flat_views`` and ``_pack_views`` are kept by; None where the tensors are produced lazily or
        one is missing (the full path names it)."""
        if not isinstance(named_tensors, Mapping) or self._after_pack is not None:
            return None
        try:
            return manifest.layout_digest(), tuple(named_tensors[t.name].data_ptr() for t in manifest.tensors)
        except KeyError:
            return None

    def _flat_views(self, manifest: Manifest, named_tensors: NamedTensors,
                    addresses: tuple | None) -> list[torch.Tensor] | None:
        """Every bucket as a view of existing memory, or None if some bucket needs packing.

        The check of names and shapes (``TensorSource``) and the view building run on
        the first sync of a layout; later syncs only compare the tensors' addresses.
        """
        if addresses is None:
            return None

        def build():
            source = TensorSource(manifest, named_tensors)
            views = [contiguous_bucket(plan, source.take(plan)) for plan in manifest.buckets]
            return None if any(v is None for v in views) else views

        return kept(self._views, addresses, build)

    def _pack_views(self, manifest: Manifest, named_tensors: NamedTensors, addresses: tuple | None,
                    slots: list[dict[str, torch.Tensor]]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None:
        """Per bucket, (destinations in its slot's buffer, sources), or None where the tensors are
        produced lazily or not contiguous (packed entry by entry then)."""
        if addresses is None:
            return None
        key = (*addresses, tuple(b.data_ptr() for slot in slots for b in slot.values()))

        def build():
            tensors = [named_tensors[t.name] for t in manifest.tensors]
            if not all(t.is_contiguous() for t in tensors):
                return None
            source = TensorSource(manifest, named_tensors)  # checks names and shapes
            packs = []
            for i, plan in enumerate(manifest.buckets):
                buf, held = slots[i % len(slots)][plan.dtype], source.take(plan)
                packs.append(([buf[e.bucket_offset : e.bucket_offset + e.numel] for e in plan.entries],
                              [held[e.name].reshape(-1)[e.tensor_offset : e.tensor_offset + e.numel]
                               for e in plan.entries]))
            return packs

        return kept(self._packs, key, build)

    def _buffers(self, manifest: Manifest, slack: int = 0) -> list[dict[str, torch.Tensor]]:
        key = f"{manifest.layout_digest()}+{slack}"
        if self._slots_key != key:  # kept across syncs of the same layout
            self._slots = [bucket_buffers(manifest, self.device, slack) for _ in range(self.num_buffers)]
            self._slots_key = key
        return self._slots

    def _packer(self, manifest: Manifest, named_tensors: NamedTensors | None,
                fill: BucketFill | None) -> Packer:
        """How each bucket of this send is made: a view of flat parameters, a fill, one fused copy of
        cached views, or entry by entry (``send``'s sources)."""
        addresses = self._addresses(manifest, named_tensors) if fill is None else None
        views = self._flat_views(manifest, named_tensors, addresses)
        slots = self._buffers(manifest, fill.slack if fill is not None else 0) if views is None else []
        packs = self._pack_views(manifest, named_tensors, addresses, slots) if views is None else None
        source = TensorSource(manifest, named_tensors) if fill is None and views is None and packs is None else None
        return Packer(manifest, views, slots, fill, packs, source, self._after_pack is None)

    @torch.no_grad()
    def send(self, manifest: Manifest, named_tensors: NamedTensors | None = None,
             fill: BucketFill | None = None, go: Callable[[], None] | None = None,
             early: EarlyPack | None = None, header_first: bool = False) -> SendStats:
        """Send every bucket of ``manifest`` in order; every receiver must be receiving.

        The buckets' contents come from ``named_tensors`` - a mapping name -> full
        tensor, or a callable returning an iterable of (name, tensor) in manifest
        order - or from ``fill``, which writes a bucket's elements into the buffer
        it is given (e.g. gathering FSDP shards straight into it). Raises
        ``ValueError`` for a tensor missing or of the wrong shape (receivers then
        time out), and ``TransportError`` when a broadcast fails.

        ``go`` (an armed push): called once the send is set up (its packing planned, the header on
        the device) and before any value is read; the header goes out the moment it returns, and
        ``seconds`` count from then. It may raise to call the send off with nothing on the wire.
        ``early`` (with ``go``): the first buckets may be packed before the word (``EarlyPack``).
        ``header_first`` (with ``go``; every receiver's armed receive takes the header before its own
        word: ``receive_weights(header_first=True)``): the header goes out before ``go``, so that after
        the word only buckets are posted; a send called off in ``go`` still waits for the header to
        be taken (the group stays in step). On a GPU it is copied and posted on a stream of its own,
        which no kernel of the train step running meanwhile is queued on.
        """
        if (named_tensors is None) == (fill is None):
            raise ValueError("WeightSender.send needs exactly one of named_tensors and fill")
        return self._send(_Dense(self, manifest, early), named_tensors, fill, go, header_first and go is not None)

    @torch.no_grad()
    def send_delta(self, manifest: Manifest, image: DeltaImage, named_tensors: NamedTensors | None = None,
                   fill: BucketFill | None = None, dense: bool = False, estimate: bool = False,
                   go: Callable[[], None] | None = None) -> SendStats:
        """Send ``manifest``'s version as the changes from the version ``image`` holds; every receiver
        must be in ``receive_delta`` with its own image. Dense where ``image`` holds no version, or
        with ``dense`` (``transport.delta=auto`` finding dense faster); the image then follows anyway.

        A delta packs and compares every bucket with the image first (the receivers need each
        bucket's form and size before its bytes). A dense sync knows every size up front: each
        bucket goes out as it is packed, from the image's copy of it. The wire carries a header of
        four numbers (``wire.delta_header``: ``header_for`` and the base version, 0 for dense), a table
        of (form, changed elements) per bucket, then one payload per bucket that changed (``delta``);
        with ``verify``, each is followed by the checksum of the whole new bucket. A failed send leaves
        the image holding no version. With ``estimate``, a dense sync against an image that holds a
        version first times encoding its first bucket as a delta (``delta.estimate``; not counted in its
        ``seconds``), for ``transport.delta=auto``. Sources, errors and ``go`` as in ``send`` (here
        ``go`` comes before the packing, as a delta's header needs its buckets compared first)."""
        if (named_tensors is None) == (fill is None):
            raise ValueError("WeightSender.send_delta needs exactly one of named_tensors and fill")
        return self._send(_Delta(self, manifest, image, dense, estimate), named_tensors, fill, go)

    def _send(self, way: "_Dense | _Delta", named_tensors: NamedTensors | None, fill: BucketFill | None,
              go: Callable[[], None] | None, header_first: bool = False) -> SendStats:
        """The one send loop, dense or delta (``way``: what the header says and what each bucket sends):
        set up, the driver's word, the header, every bucket in order, then the host waits for all of it."""
        out = _Outgoing(self.group, self.src)
        if header_first:  # out before anything that can fail: every armed receive takes it before its word
            with self._header_stream():
                out.copy_header(way.header())
                out.post_header()
        try:
            way.plan(self._packer(way.manifest, named_tensors, fill))
            out.stamps["planned"] = time.time()  # (a delta's comparing comes after the word: encode_s)
            if not header_first:
                out.copy_header(way.header())  # a dense header: on the device before the word
            way.offer_early()
            if go is not None:
                go()
                out.t0 = time.perf_counter()
        except BaseException:
            out.settle()  # a header out before the word: taken before this send ends (in step)
            raise
        finally:
            way.take_early(out.stamps)
        way.compare(out.t0)
        if not header_first:
            if out.header is None:
                out.copy_header(way.header())  # a delta's: known once its buckets were compared
            out.post_header()
        for i in range(len(way.manifest.buckets)):
            sent = way.bucket(i, out)
            if sent is not None:
                out.post(*sent)
        return way.finish(out, out.end(self.device))


Checksum = torch.Tensor | Callable[[], torch.Tensor] | None
"""A bucket's checksum (``verify``): made with the bucket, or how to make it once the bucket is posted."""


class _Outgoing:
    """One send's side of the wire: its header and buckets posted in order, the ops to wait for, the
    tensors they read (kept alive until then), its clock readings (``SendStats.stamps``)."""

    def __init__(self, group: TransportGroup, src: int) -> None:
        self.group, self.src = group, src
        self.t0 = time.perf_counter()  # ``seconds`` count from here, or from the word
        self.stamps = {"send": time.time()}
        self.header: list[torch.Tensor] | None = None
        self.header_unix_s = 0.0
        self.finished: list = []  # ops to wait for on the host at the end, oldest first
        self.in_flight: deque = deque()  # each posted bucket's ops, oldest first
        self.kept: list[torch.Tensor] = []  # the checksums on the wire

    def copy_header(self, rows: list[list[int]] | None) -> None:
        """The header's numbers (``wire``) onto the group's device; None: not known yet."""
        if rows is not None:
            self.header = [ints_on(row, self.group.device) for row in rows]
            self.stamps["header_copied"] = time.time()

    def post_header(self) -> None:
        # Not waited for here: the buckets queue behind it on the wire (ops complete in order).
        self.finished += [self.group.broadcast_async(t, self.src, count_bytes=False) for t in self.header]
        self.header_unix_s = time.time()

    def settle(self) -> None:
        """Wait for what was posted (a send called off: the header out before the word was taken)."""
        for op in self.finished:
            op.wait()

    def free_slot(self, num_buffers: int) -> None:
        """With ``num_buffers`` buckets on the wire, the oldest's buffer slot must be off it before the
        slot is repacked."""
        if len(self.in_flight) == num_buffers:
            for op in self.in_flight.popleft():
                op.wait(host=False)
                self.finished.append(op)

    def post(self, bucket: torch.Tensor, checksum: Checksum) -> None:
        ops = [self.group.broadcast_async(bucket, self.src)]
        self.stamps.setdefault("first", time.time())
        faults.hit("send_bucket")
        if checksum is not None:
            self.kept.append(checksum() if callable(checksum) else checksum)
            ops.append(self.group.broadcast_async(self.kept[-1], self.src, count_bytes=False))
        self.in_flight.append(ops)

    def end(self, device: torch.device) -> float:
        """Wait for every op on the host (timeouts, errors, byte counts), oldest first; the seconds."""
        for op in self.finished + [op for ops in self.in_flight for op in ops]:
            op.wait()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        self.header, self.kept = None, []  # alive until their broadcasts completed
        return time.perf_counter() - self.t0


class _Dense:
    """A dense send's buckets (``WeightSender.send``): each packed as it goes out, into a buffer slot
    whose previous bucket has left the wire, with its checksum (``verify``); an armed push's first
    ones maybe packed before the word (``EarlyPack``). Its header is known before anything is read."""

    def __init__(self, sender: WeightSender, manifest: Manifest, early: EarlyPack | None) -> None:
        self.sender, self.manifest, self.early = sender, manifest, early
        self.pack: Packer | None = None
        self.made: list = []  # the buckets packed early, each (bucket, checksum)

    def header(self) -> list[list[int]]:
        return [header_for(self.manifest)]

    def plan(self, pack: Packer) -> None:
        self.pack = pack

    def make(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bucket ``i`` ready for the wire, and its checksum (``verify``)."""
        packed = self.pack(i)
        checksum = bucket_checksum(packed) if self.sender.verify else None
        if self.sender._after_pack is not None:
            self.sender._after_pack(self.manifest.buckets[i].index, packed)
        return packed, checksum

    def offer_early(self) -> None:
        if self.early is None or not self.pack.slotted:  # (every slot free: the send before ended with the wire)
            return
        first = range(min(self.sender.num_buffers, len(self.manifest.buckets)))

        def make_first() -> list:
            with torch.no_grad():  # (in the train step's thread, where autograd is on)
                return [self.make(i) for i in first]

        self.early.offer(make_first)

    def take_early(self, stamps: dict[str, float]) -> None:
        self.made = self.early.take() if self.early is not None else []
        if self.made:
            stamps["early_packed"] = self.early.packed_unix_s

    def compare(self, t0: float) -> None:
        """(A dense send compares nothing.)"""

    def bucket(self, i: int, out: _Outgoing) -> tuple[torch.Tensor, Checksum]:
        if i < len(self.made):
            return self.made[i]
        if self.pack.slotted:
            out.free_slot(self.sender.num_buffers)
        return self.make(i)

    def finish(self, out: _Outgoing, seconds: float) -> SendStats:
        group, manifest = self.sender.group, self.manifest
        total = sum(p.nbytes for p in manifest.buckets)
        stats = SendStats(bytes=total, seconds=seconds, num_buckets=len(manifest.buckets),
                          header_unix_s=out.header_unix_s, dense_bytes=total, stamps=out.stamps,
                          early_buckets=len(self.made))
        log.debug("[transport:%s:%d] sent policy_version=%d: %d buckets, %.1f MiB in %.3f s",
                  group.name, group.rank, manifest.policy_version, stats.num_buckets, stats.bytes / 2**20, seconds)
        return stats


class _Delta:
    """A delta send's buckets (``WeightSender.send_delta``): after the word, every bucket packed and
    compared with the image (the header's table needs each one's form), the image taking the new
    bucket; then each that changed goes out as its payload, or as the image's copy of it where it
    goes dense. The image holds no version until the last op completed."""

    def __init__(self, sender: WeightSender, manifest: Manifest, image: DeltaImage, dense: bool,
                 estimate: bool) -> None:
        self.sender, self.manifest, self.image, self.dense, self.estimate = sender, manifest, image, dense, estimate
        self.pack: Packer | None = None
        self.bufs: list[torch.Tensor] = []  # the image's buckets
        self.held: int | None = None  # the version the image held
        self.base: int | None = None  # the version the delta is made against (None: dense)
        self.deltas: list[BucketDelta] = []
        self.marks: list[torch.Tensor] = []  # ``one_read``: each bucket's changed bits
        self.table: list[int] | None = None  # known once every bucket was compared
        self.encode_s = 0.0
        self.guess: tuple[float, float] | None = None  # ``estimate``'s
        self.guess_s = 0.0

    def header(self) -> list[list[int]] | None:
        return None if self.table is None else [delta_header(self.manifest, self.base), self.table]

    def plan(self, pack: Packer) -> None:
        self.bufs = self.image.buckets(self.manifest)  # a new layout holds no version
        self.pack = pack

    def offer_early(self) -> None:
        """(A delta packs nothing before the word.)"""

    def take_early(self, stamps: dict[str, float]) -> None:
        """(Nor early.)"""

    def compare(self, t0: float) -> None:
        """Each bucket's form against the image (none where the sync is dense), the image then
        holding the new buckets; ``encode_s`` from ``t0``."""
        self.held = self.image.version
        self.base, self.image.version = None if self.dense else self.held, None
        if self.base is None:
            self.deltas = [BucketDelta(Form.DENSE, p.numel, p.numel, None) for p in self.manifest.buckets]
        elif self.sender.one_read:
            counts = []
            for i, buf in enumerate(self.bufs):
                packed = self.pack(i)
                bits, count = mark(packed, buf)
                self.marks.append(bits)
                counts.append(count)
                buf.copy_(packed)  # the image holds the new bucket; its changes are in the bits
            counts = torch.stack(counts).tolist()  # this sync's one host read
            self.deltas = [BucketDelta(choose_form(b.numel(), c, b.element_size()), b.numel(), c, None)
                           for b, c in zip(self.bufs, counts)]
        else:
            for i, buf in enumerate(self.bufs):
                packed = self.pack(i)
                self.deltas.append(encode(packed, buf))
                if self.deltas[-1].form is not Form.SAME:
                    buf.copy_(packed)
        self.encode_s = time.perf_counter() - t0
        self.table = table_for([(d.form, d.changed) for d in self.deltas])

    def bucket(self, i: int, out: _Outgoing) -> tuple[torch.Tensor, Checksum] | None:
        d, buf = self.deltas[i], self.bufs[i]
        if d.form is Form.SAME:
            return None
        if d.form in (Form.INDEX, Form.MASK) and d.payload is None:  # marked: encoded as it goes out
            d = self.deltas[i] = encode_marked(buf, self.marks[i], d.changed)
        if self.base is None:
            packed = self.pack(i)
            if i == 0 and self.estimate and self.held is not None:  # before anything of this sync is on the wire
                t_guess = time.perf_counter()
                numel = sum(p.numel for p in self.manifest.buckets)
                self.guess = estimate_delta(packed, buf, numel, self.sender.one_read)
                self.guess_s = time.perf_counter() - t_guess
            buf.copy_(packed)  # its slot is free again at once: the image's copy goes on the wire
        checksum = (lambda: bucket_checksum(buf)) if self.sender.verify else None  # made once its bytes are posted
        return buf if d.form is Form.DENSE else d.payload, checksum

    def finish(self, out: _Outgoing, seconds: float) -> SendStats:
        group, manifest, base = self.sender.group, self.manifest, self.base
        self.image.version = manifest.policy_version
        total = sum(p.nbytes for p in manifest.buckets)
        wire = sum(d.nbytes if d.form is not Form.DENSE else p.nbytes for d, p in zip(self.deltas, manifest.buckets))
        changed = sum(d.changed for d in self.deltas) / max(1, sum(p.numel for p in manifest.buckets))
        stats = SendStats(bytes=wire, seconds=seconds - self.guess_s, num_buckets=len(manifest.buckets),
                          header_unix_s=out.header_unix_s, dense_bytes=total, delta_base=base or 0,
                          changed_fraction=None if base is None else changed, encode_s=self.encode_s if base else 0.0,
                          estimate=self.guess, stamps=out.stamps)
        log.debug("[transport:%s:%d] sent policy_version=%d against %s: %.2f of %.1f MiB in %.3f s",
                  group.name, group.rank, manifest.policy_version, base or "nothing (dense)", wire / 2**20,
                  total / 2**20, stats.seconds)
        return stats
