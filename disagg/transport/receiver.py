"""The receiving side of a weight sync: check the header, take buckets, load.

One receive loop (``_receive``) takes a dense version (``receive_weights``) and a delta
(``receive_delta``) alike: the header, each bucket's receive posted ahead of the one taken, the
checksums, the loads. What differs, where a bucket lands and when it is loaded, is its way
(``_DenseLanding``, ``_DeltaLanding``). Every receiver runs it (the vLLM worker, the GPU benchmarks,
the tests); only the ``load_fn`` differs. ``TorchModelReceiver`` is the ``load_fn`` for a plain
``torch.nn.Module``, used where vLLM cannot run.

This module must never load a bucket whose header did not match its manifest,
and never import vLLM or Ray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg import faults
from disagg.errors import ChecksumError, DeltaRefused, TransportError
from disagg.transport.buckets import PartLoader, Reassembler, bucket_buffers, bucket_checksum
from disagg.transport.delta import DeltaImage, Form, apply, payload_bytes
from disagg.transport.group import TransportGroup
from disagg.transport.manifest import Manifest
from disagg.transport.wire import CHECKSUM_INTS, DELTA_HEADER_INTS, HEADER_INTS, SOURCE, check_header, read_table

log = logging.getLogger(__name__)

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


@dataclass(frozen=True)
class ReceiveStats:
    bytes: int  # payload bytes received (the manifest's total_bytes)
    seconds: float  # wall time from the header to the last load
    num_buckets: int
    num_tensors: int  # tensors handed to load_fn
    header_s: float = 0.0  # from the start to the sender's header matched: waiting for the sender
    header_unix_s: float = 0.0  # the clock reading when it matched (where the wire starts, unless header_first)
    posted_unix_s: float = 0.0  # the first buckets' receives posted (the wire starts once the sender's are)
    wire_end_unix_s: float = 0.0  # the host saw the last bucket received (its ops complete)
    loaded_unix_s: float = 0.0  # the loads done on the device (the stream synchronised)
    go_wait_s: float = 0.0  # an armed receive: its wait for the sender's word (``go``), before the sync's part
    go_unix_s: float = 0.0  # an armed receive: the clock reading when the word came (0: not armed)


def receive_weights(group: TransportGroup, manifest: Manifest, load_fn: LoadFn,
                    device: torch.device = torch.device("cpu"), *, num_buffers: int = 2, verify: bool = False,
                    go: Callable[[TransportGroup], None] | None = None, parts: PartLoader | None = None,
                    header_first: bool = False) -> ReceiveStats:
    """Receive one policy version from the group's source (``wire.SOURCE``) and hand it to ``load_fn``.

    Pipelined over ``num_buffers`` buffers: while bucket i is being loaded, the
    next ones are already on the wire. ``load_fn`` is called with the tensors each
    bucket completed; they may be views into a receive buffer that is reused once
    ``load_fn`` returns, so it must copy what it keeps.

    With ``verify`` every bucket's checksum is compared and nothing is loaded
    until all buckets arrived intact (they are staged, costing one copy of the
    weights): a mismatch raises ``ChecksumError`` after the last bucket, with
    ``load_fn`` never called, so the receiver keeps its previous weights and the
    group stays in step. Raises ``TransportError`` if the sender's header
    disagrees with ``manifest`` or a broadcast fails.

    ``go`` (an armed receive): called with the group once everything is ready and before
    anything is posted; it returns when the sender is about to send, or raises (e.g.
    ``SyncCancelled``) with the group still in step; its wait is ``go_wait_s`` of the figures, apart
    from ``seconds``. With ``header_first`` (the sender's armed push sends its header before its
    word: ``WeightSender.send(header_first=True)``) the header is taken and checked before ``go``,
    and only the buckets are posted after it.

    ``parts``: the tensors split over buckets it names go to it a part at a time, as their buckets
    arrive, instead of being assembled and handed to ``load_fn``; with its ``bucket``, whole buckets
    at once (not with ``verify``, which loads nothing before every bucket arrived intact).
    """
    _check_receiver(group, "receive_weights")
    if num_buffers < 1:
        raise ValueError(f"transport.num_buffers must be >= 1, got {num_buffers}")
    if verify and parts is not None:
        raise ValueError("receive_weights: parts are loaded as they arrive, which verify forbids")
    way = _DenseLanding(group, manifest, device, num_buffers, parts)
    return _receive(_Receive(group, manifest, load_fn, device, verify, way), go, header_first)


def receive_delta(group: TransportGroup, manifest: Manifest, load_fn: LoadFn, image: DeltaImage,
                  device: torch.device = torch.device("cpu"), *, verify: bool = False,
                  go: Callable[[TransportGroup], None] | None = None, load_unchanged: bool = False) -> ReceiveStats:
    """Receive one policy version sent by ``WeightSender.send_delta``: apply each bucket's changes
    onto ``image``, then load the tensors of every bucket that changed (every tensor after a dense
    sync, or with ``load_unchanged``: a loader that needs whole layers). Nothing is loaded before
    every bucket arrived (and, with ``verify``, matched its checksum): a failure leaves the weights
    on their old version, the image holding none.

    A delta made against another version than the one ``image`` holds is taken off the wire and
    refused with ``DeltaRefused`` (the group stays in step; this receiver needs a dense sync).
    ``TransportError`` for a header that disagrees with ``manifest`` or a failed broadcast,
    ``ChecksumError`` for a corrupt bucket; ``go`` as in ``receive_weights``."""
    _check_receiver(group, "receive_delta")
    way = _DeltaLanding(group, manifest, image, device, load_unchanged)
    return _receive(_Receive(group, manifest, load_fn, device, verify, way), go)


def _check_receiver(group: TransportGroup, what: str) -> None:
    if group.rank == SOURCE:
        raise ValueError(f"{what} runs on receivers; rank {SOURCE} is the sender")


def _receive(recv: "_Receive", go: Callable[[TransportGroup], None] | None, header_first: bool = False) -> ReceiveStats:
    """The one receive loop, dense or delta (``recv.way``): the header (before an armed receive's
    word with ``header_first``, else after it), every bucket in order, then the checks and the loads."""
    if go is not None and header_first:
        recv.take_header()
        recv.wait_for(go)
        recv.t0 = time.perf_counter()  # the sync's part starts at the word (the header matched before it)
        recv.post_first()
    else:
        if go is not None:
            recv.wait_for(go)
        recv.start()
    for i in range(len(recv.buckets)):
        recv.take(i)
    return recv.finish()


class _Receive:
    """One receive: the header, each bucket's receive posted ``way.depth`` buckets ahead of the one
    taken, the ops to wait for on the host, the checksums to compare, its figures. Where a bucket
    lands and what is loaded when is its ``way``'s."""

    def __init__(self, group: TransportGroup, manifest: Manifest, load_fn: LoadFn, device: torch.device,
                 verify: bool, way: "_DenseLanding | _DeltaLanding") -> None:
        self.group, self.manifest, self.load_fn, self.device = group, manifest, load_fn, device
        self.verify, self.way = verify, way
        self.buckets = manifest.buckets
        self.pending: dict[int, tuple[list, torch.Tensor, torch.Tensor | None]] = {}
        self.sums: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # verify: (bucket, computed, received)
        self.finished: list = []  # ops waited on the stream (or not yet), to wait on the host at the end
        self.num_tensors = 0
        self.wire_bytes = 0
        self.t0 = 0.0
        self.header_s = 0.0
        self.posted_unix_s = 0.0
        self.go_wait_s = 0.0
        self.go_unix_s = 0.0

    def start(self) -> None:
        """Post the header and the first buckets; return once the header matched."""
        group = self.group
        self.t0 = time.perf_counter()
        header_op = group.broadcast_async(self.way.header, SOURCE, count_bytes=False)
        # NCCL: the first buckets' receives are posted before the header is read, so the
        # header's round trip does not delay the wire; they land in this receiver's own
        # buffers, and nothing is loaded before the header matched. gloo cannot drop a
        # posted receive (releasing its group waits for the op), so it checks first; so does
        # a delta, whose receives' sizes follow its header.
        if not (self.way.posts_before_header and group.backend == "nccl"):
            header_op.wait()
            self._header_matched()
            self.post_first()
            return
        self.post_first()
        header_op.wait()
        try:
            self._header_matched()
        except TransportError as e:
            # Receives of this receiver's sizes are posted: the group is out of step with the sender.
            group.abandon(str(e))
            raise

    def _header_matched(self) -> None:
        check_header(self.group, self.manifest, self.way.header)
        self.header_s = time.perf_counter() - self.t0
        self.way.after_header(self)

    def wait_for(self, go: Callable[[TransportGroup], None]) -> None:
        """An armed receive's wait for the sender's word, timed apart from the sync."""
        t = time.perf_counter()
        go(self.group)
        self.go_wait_s = time.perf_counter() - t
        self.go_unix_s = time.time()  # the sync's part starts here

    def take_header(self) -> None:
        """The header alone, taken and checked (``header_first``: before the armed receive's word)."""
        self.group.broadcast_async(self.way.header, SOURCE, count_bytes=False).wait()
        check_header(self.group, self.manifest, self.way.header)
        self.way.after_header(self)

    def post_first(self) -> None:
        """Post the first ``way.depth`` buckets' receives."""
        for i in range(min(self.way.depth, len(self.buckets))):
            self._post(i)
        self.posted_unix_s = time.time()

    def _post(self, i: int) -> None:
        buf = self.way.into(i)
        if buf is None:  # nothing sent
            return
        ops = [self.group.broadcast_async(buf, SOURCE)]
        self.wire_bytes += buf.numel() * buf.element_size()
        checksum = None
        if self.verify:
            checksum = torch.zeros(CHECKSUM_INTS, dtype=torch.int64, device=self.device)
            ops.append(self.group.broadcast_async(checksum, SOURCE, count_bytes=False))
        self.pending[i] = (ops, buf, checksum)

    def take(self, i: int) -> None:
        """Bucket ``i``'s turn (``way.take``); its buffer then takes the bucket ``way.depth`` ahead."""
        self.way.take(self, i, *self.pending.pop(i, ([], None, None)))
        if i + self.way.depth < len(self.buckets):
            self._post(i + self.way.depth)

    def check_sums(self) -> None:
        """Refuse a corrupt version: ``ChecksumError`` naming the buckets whose checksums differ."""
        corrupt = _mismatched(self.sums)
        if corrupt:
            raise ChecksumError(
                f"group {self.group.name!r} rank {self.group.rank}: policy_version={self.manifest.policy_version} "
                f"rejected: checksum mismatch in {len(corrupt)} of {len(self.buckets)} buckets (first "
                f"{corrupt[:5]}); nothing loaded"
            )

    def finish(self) -> ReceiveStats:
        """Wait for every op on the host, land the version (``way.land``: checked, loaded); the figures."""
        for op in self.finished:  # host-side completion: timeouts, errors, byte counts
            op.wait()
        wire_end = time.time()
        self.way.land(self)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        seconds = time.perf_counter() - self.t0
        loaded = time.time()
        stats = ReceiveStats(bytes=self.wire_bytes, seconds=seconds, num_buckets=len(self.buckets),
                             num_tensors=self.num_tensors, header_s=self.header_s,
                             header_unix_s=loaded - (seconds - self.header_s), wire_end_unix_s=wire_end,
                             loaded_unix_s=loaded, posted_unix_s=self.posted_unix_s, go_wait_s=self.go_wait_s,
                             go_unix_s=self.go_unix_s)
        self.way.landed(self, stats)
        return stats


class _DenseLanding:
    """Where a dense sync's buckets land (``receive_weights``): ``num_buffers`` receive buffers in
    turn, each bucket loaded as it arrives (with ``verify``, staged until every checksum matched)."""

    def __init__(self, group: TransportGroup, manifest: Manifest, device: torch.device, num_buffers: int,
                 parts: PartLoader | None) -> None:
        self.header = torch.zeros(HEADER_INTS, dtype=torch.int64, device=device)
        self.posts_before_header = True  # (on NCCL) every receive's size is known from the manifest
        self.depth = num_buffers
        self.buckets = manifest.buckets
        self.slots = _slots(group, manifest, device, num_buffers)
        self.reassembler = Reassembler(manifest, device=device, parts=parts)
        self.whole = parts.bucket if parts is not None else None  # loads a bucket at once, where it can
        self.staged: list[tuple[str, torch.Tensor]] = []  # verify: every tensor, until all checksums passed

    def after_header(self, recv: _Receive) -> None:
        """(A dense header says everything.)"""

    def into(self, i: int) -> torch.Tensor:
        plan = self.buckets[i]
        return self.slots[i % self.depth][plan.dtype][: plan.numel]

    def take(self, recv: _Receive, i: int, ops: list, buf: torch.Tensor, checksum: torch.Tensor | None) -> None:
        """Bucket ``i`` off the wire: checked (verify), its completed tensors loaded or staged."""
        plan = self.buckets[i]
        for op in ops:
            op.wait(host=False)  # NCCL: the checksum, copies and loads below are stream-ordered after it
            recv.finished.append(op)
        faults.hit("receive_bucket")
        if checksum is not None:  # compared in land(), all buckets with one host read
            recv.sums.append((plan.index, bucket_checksum(buf), checksum))
        completed = self.whole(plan, buf) if self.whole is not None else None
        if completed is None:
            done = self.reassembler.feed(plan, buf)
        else:  # loaded whole: one fused copy, no Python per tensor before the next bucket is posted
            done = self.reassembler.skip(plan)
            recv.num_tensors += completed
        recv.num_tensors += len(done)
        if recv.verify:
            self.staged.extend((name, t.clone()) for name, t in done)  # out of the reused buffer
        elif done:
            recv.load_fn(done)

    def land(self, recv: _Receive) -> None:
        """Refuse a corrupt version, load what is left."""
        rest = self.reassembler.finish()
        recv.num_tensors += len(rest)
        recv.check_sums()
        if self.staged or rest:
            recv.load_fn(self.staged + rest)

    def landed(self, recv: _Receive, stats: ReceiveStats) -> None:
        log.debug("[transport:%s:%d] received policy_version=%d: %d tensors in %d buckets, %.1f MiB in %.3f s",
                  recv.group.name, recv.group.rank, recv.manifest.policy_version, stats.num_tensors,
                  stats.num_buckets, stats.bytes / 2**20, stats.seconds)


class _DeltaLanding:
    """Where a delta sync's buckets land (``receive_delta``): on ``image``. Its header names the base
    version and is followed by a table of every bucket's form, so every payload's receive is posted
    at once after it; nothing is applied before every payload arrived (a delta against another
    version than the image holds is refused with the group in step), and nothing is loaded before
    every checksum matched."""

    def __init__(self, group: TransportGroup, manifest: Manifest, image: DeltaImage, device: torch.device,
                 load_unchanged: bool) -> None:
        self.header = torch.zeros(DELTA_HEADER_INTS, dtype=torch.int64, device=group.device)
        self.posts_before_header = False  # the payloads' sizes come with the table
        self.depth = len(manifest.buckets)  # every receive posted at once
        self.manifest, self.image, self.device, self.load_unchanged = manifest, image, device, load_unchanged
        self.base = 0  # the version the delta was made against (0: dense)
        self.held: int | None = None  # the version the image held
        self.refused = False
        self.forms: list[tuple[Form, int]] = []
        self.bufs: list[torch.Tensor] = []  # the image's buckets
        self.posted: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # bucket -> (payload, checksum)

    def after_header(self, recv: _Receive) -> None:
        """The table, and whether the image holds the base (a refused delta is still taken off the wire)."""
        self.base = int(self.header[HEADER_INTS])
        table = torch.zeros(2 * len(self.manifest.buckets), dtype=torch.int64, device=recv.group.device)
        recv.group.broadcast_async(table, SOURCE, count_bytes=False).wait()
        self.forms = read_table(table)
        self.bufs = self.image.buckets(self.manifest)
        if faults.hit("delta_image_lost"):
            self.image.invalidate()
        self.refused = self.base != 0 and self.image.version != self.base
        self.held, self.image.version = self.image.version, None  # rewritten from here on

    def into(self, i: int) -> torch.Tensor | None:
        (form, changed), buf = self.forms[i], self.bufs[i]
        if form is Form.SAME:
            return None
        if form is Form.DENSE:
            return buf
        size = payload_bytes(form, self.manifest.buckets[i].numel, changed, buf.element_size())
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def take(self, recv: _Receive, i: int, ops: list, buf: torch.Tensor | None,
             checksum: torch.Tensor | None) -> None:
        """Not waited for yet: every payload lands before any is applied."""
        recv.finished += ops
        if buf is not None:
            self.posted[i] = (buf, checksum)

    def land(self, recv: _Receive) -> None:
        """Refuse a delta against another version or a corrupt one; apply, then load what changed."""
        faults.hit("receive_bucket")
        if self.refused:
            group, held = recv.group, "none" if self.held is None else f"version {self.held}"
            raise DeltaRefused(f"group {group.name!r} rank {group.rank}: policy_version={self.manifest.policy_version} "
                               f"was sent as changes to version {self.base}, this receiver holds {held}; nothing "
                               "loaded, a dense sync is needed")
        for i, (plan, buf, (form, changed)) in enumerate(zip(self.manifest.buckets, self.bufs, self.forms)):
            payload, checksum = self.posted.get(i, (None, None))
            if form in (Form.INDEX, Form.MASK):
                apply(buf, form, changed, payload)
            if checksum is not None:
                recv.sums.append((plan.index, bucket_checksum(buf), checksum))
        recv.check_sums()
        every = self.base == 0 or self.load_unchanged
        changed_names = {e.name for plan, (form, _) in zip(self.manifest.buckets, self.forms) if form is not Form.SAME
                         for e in plan.entries}
        reassembler = Reassembler(self.manifest, device=self.device)
        for plan, buf in zip(self.manifest.buckets, self.bufs):
            done = [(n, t) for n, t in reassembler.feed(plan, buf) if every or n in changed_names]
            if done:
                recv.load_fn(done)
                recv.num_tensors += len(done)
        rest = reassembler.finish()
        if rest and every:
            recv.load_fn(rest)
            recv.num_tensors += len(rest)

    def landed(self, recv: _Receive, stats: ReceiveStats) -> None:
        """The image holds the version now."""
        self.image.version = self.manifest.policy_version
        log.debug("[transport:%s:%d] received policy_version=%d against %s: %d tensors loaded, %.2f MiB in %.3f s",
                  recv.group.name, recv.group.rank, self.manifest.policy_version, self.base or "nothing (dense)",
                  stats.num_tensors, stats.bytes / 2**20, stats.seconds)


def _mismatched(sums: list[tuple[int, torch.Tensor, torch.Tensor]]) -> list[int]:
    """The bucket indices whose checksum (computed here, received) differ, from (index, computed,
    received) per bucket: one host read for all of them (on GPUs a read per bucket would stall the
    stream once per bucket)."""
    if not sums:
        return []
    mine, theirs = torch.stack([t for _, t, _ in sums]), torch.stack([t for _, _, t in sums])
    matched = (mine == theirs).all(dim=1).tolist()
    return [index for (index, _, _), ok in zip(sums, matched) if not ok]


def _slots(group: TransportGroup, manifest: Manifest, device: torch.device,
           num_buffers: int) -> list[dict[str, torch.Tensor]]:
    """Receive buffers, kept on the group across syncs of the same layout (fresh pages cost as much as the wire on CPU)."""
    key = (manifest.layout_digest(), str(device), num_buffers)
    if key not in group.buffers:
        group.buffers.clear()
        group.buffers[key] = [bucket_buffers(manifest, device) for _ in range(num_buffers)]
    return group.buffers[key]


class TorchModelReceiver:
    """A ``load_fn`` that copies received tensors into a module's state dict by name.

    Use ``TorchModelReceiver.load_into_module(module)``. Tensors are cast to the
    module's dtype on copy; an unknown name or a shape mismatch raises
    ``ValueError`` naming it. ``loaded`` records the names written, so a caller
    can check with ``assert_complete`` that no entry kept its old (e.g. dummy)
    values.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._targets = module.state_dict(keep_vars=True)
        self.loaded: set[str] = set()

    @classmethod
    def load_into_module(cls, module: torch.nn.Module) -> "TorchModelReceiver":
        return cls(module)

    def check_manifest(self, manifest: Manifest) -> None:
        """Raise before any byte moves if ``manifest`` does not fit the module."""
        problems = [self._problem(t.name, t.shape) for t in manifest.tensors]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(f"manifest does not fit the module: {'; '.join(problems[:10])}")

    def __call__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in tensors:
                problem = self._problem(name, tuple(tensor.shape))
                if problem:
                    raise ValueError(problem)
                self._targets[name].copy_(tensor)
                self.loaded.add(name)

    def assert_complete(self) -> None:
        """Raise naming the state-dict entries no received tensor was loaded into."""
        missing = sorted(set(self._targets) - self.loaded)
        if missing:
            raise ValueError(f"{len(missing)} module entries were never loaded (first {missing[:5]})")

    def _problem(self, name: str, shape: tuple[int, ...]) -> str | None:
        target = self._targets.get(name)
        if target is None:
            return f"unknown tensor name {name!r} (not in the module's state dict)"
        if tuple(target.shape) != tuple(shape):
            return f"shape mismatch for {name!r}: received {tuple(shape)}, module has {tuple(target.shape)}"
        return None
