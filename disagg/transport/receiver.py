"""The receiving side of a weight sync: check the header, take buckets, load.

``receive_weights`` is the one receive loop every receiver runs (the vLLM worker,
the GPU benchmarks, the tests); only the ``load_fn`` differs. ``TorchModelReceiver``
is the ``load_fn`` for a plain ``torch.nn.Module``, used where vLLM cannot run.

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
from disagg.transport.sender import header_for

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


def receive_weights(
    group: TransportGroup,
    manifest: Manifest,
    load_fn: LoadFn,
    device: torch.device = torch.device("cpu"),
    src: int = 0,
    num_buffers: int = 2,
    verify: bool = False,
    go: Callable[[TransportGroup], None] | None = None,
    parts: PartLoader | None = None,
    header_first: bool = False,
) -> ReceiveStats:
    """Receive one policy version from rank ``src`` and hand it to ``load_fn``.

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
    ``SyncCancelled``) with the group still in step. With ``header_first`` (the sender's armed
    push sends its header before its word: ``WeightSender.send(header_first=True)``) the header
    is taken and checked before ``go``, and only the buckets are posted after it.

    ``parts``: the tensors split over buckets it names go to it a part at a time, as their buckets
    arrive, instead of being assembled and handed to ``load_fn``; with its ``bucket``, whole buckets
    at once (not with ``verify``, which loads nothing before every bucket arrived intact).
    """
    if group.rank == src:
        raise ValueError(f"receive_weights runs on receivers; rank {src} is the sender")
    if num_buffers < 1:
        raise ValueError(f"transport.num_buffers must be >= 1, got {num_buffers}")
    if verify and parts is not None:
        raise ValueError("receive_weights: parts are loaded as they arrive, which verify forbids")
    recv = _Receive(group, manifest, load_fn, device, src, num_buffers, verify, parts)
    if go is not None and header_first:
        recv.take_header()
        go(group)
        recv.t0 = time.perf_counter()  # the sync's part starts at the word (the header matched before it)
        recv.post_first()
    else:
        if go is not None:
            go(group)
        recv.start()
    for i in range(len(manifest.buckets)):
        recv.take(i)
    return recv.finish()


class _Receive:
    """One receive of ``receive_weights``: its buffers, the buckets on the wire, what was taken."""

    def __init__(self, group: TransportGroup, manifest: Manifest, load_fn: LoadFn, device: torch.device,
                 src: int, num_buffers: int, verify: bool, parts: PartLoader | None = None) -> None:
        self.group, self.manifest, self.load_fn, self.device = group, manifest, load_fn, device
        self.src, self.num_buffers, self.verify = src, num_buffers, verify
        self.buckets = manifest.buckets
        self.reassembler = Reassembler(manifest, device=device, parts=parts)
        self.whole = parts.bucket if parts is not None else None  # loads a bucket at once, where it can
        self.slots = _slots(group, manifest, device, num_buffers)
        self.pending: dict[int, tuple[list, torch.Tensor, torch.Tensor | None]] = {}
        self.staged: list[tuple[str, torch.Tensor]] = []  # verify: every tensor, until all checksums passed
        self.sums: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # verify: (bucket, computed, received)
        self.finished: list = []  # ops waited on the stream, to wait on the host at the end
        self.num_tensors = 0
        self.header = torch.zeros(3, dtype=torch.int64, device=device)
        self.t0 = 0.0
        self.header_s = 0.0
        self.posted_unix_s = 0.0

    def start(self) -> None:
        """Post the header and the first ``num_buffers`` buckets; return once the header matched."""
        group, header = self.group, self.header
        self.t0 = time.perf_counter()
        header_op = group.broadcast_async(header, self.src, count_bytes=False)
        # NCCL: the first buckets' receives are posted before the header is read, so the
        # header's round trip does not delay the wire; they land in this receiver's own
        # buffers, and nothing is loaded before the header matched. gloo cannot drop a
        # posted receive (releasing its group waits for the op), so it checks first.
        early = group.backend == "nccl"
        if not early:
            header_op.wait()
            _check_header(group, self.manifest, header)
            self.header_s = time.perf_counter() - self.t0
        self.post_first()
        if early:
            header_op.wait()
            try:
                _check_header(group, self.manifest, header)
            except TransportError as e:
                # Receives of this receiver's sizes are posted: the group is out of step with the sender.
                group.abandon(str(e))
                raise
            self.header_s = time.perf_counter() - self.t0

    def take_header(self) -> None:
        """The header alone, taken and checked (``header_first``: before the armed receive's word)."""
        self.group.broadcast_async(self.header, self.src, count_bytes=False).wait()
        _check_header(self.group, self.manifest, self.header)

    def post_first(self) -> None:
        """Post the first ``num_buffers`` buckets' receives."""
        for i in range(min(self.num_buffers, len(self.buckets))):
            self._post(i)
        self.posted_unix_s = time.time()

    def _post(self, i: int) -> None:
        plan = self.buckets[i]
        buf = self.slots[i % self.num_buffers][plan.dtype][: plan.numel]
        ops = [self.group.broadcast_async(buf, self.src)]
        checksum = None
        if self.verify:
            checksum = torch.zeros(2, dtype=torch.int64, device=self.device)
            ops.append(self.group.broadcast_async(checksum, self.src, count_bytes=False))
        self.pending[i] = (ops, buf, checksum)

    def take(self, i: int) -> None:
        """Bucket ``i`` off the wire: checked (verify), its completed tensors loaded or staged; its
        buffer then takes the bucket ``num_buffers`` ahead."""
        plan = self.buckets[i]
        ops, buf, checksum = self.pending.pop(i)
        for op in ops:
            op.wait(host=False)  # NCCL: the checksum, copies and loads below are stream-ordered after it
            self.finished.append(op)
        faults.hit("receive_bucket")
        if checksum is not None:  # compared in finish(), all buckets with one host read
            self.sums.append((plan.index, bucket_checksum(buf), checksum))
        completed = self.whole(plan, buf) if self.whole is not None else None
        if completed is None:
            done = self.reassembler.feed(plan, buf)
        else:  # loaded whole: one fused copy, no Python per tensor before the next bucket is posted
            done = self.reassembler.skip(plan)
            self.num_tensors += completed
        self.num_tensors += len(done)
        if self.verify:
            self.staged.extend((name, t.clone()) for name, t in done)  # out of the reused buffer
        elif done:
            self.load_fn(done)
        # Only now is this bucket's buffer free for the bucket num_buffers ahead.
        if i + self.num_buffers < len(self.buckets):
            self._post(i + self.num_buffers)

    def finish(self) -> ReceiveStats:
        """Wait for every op on the host, refuse a corrupt version, load what is left; the figures."""
        for op in self.finished:  # host-side completion: timeouts, errors, byte counts
            op.wait()
        wire_end = time.time()
        rest = self.reassembler.finish()
        self.num_tensors += len(rest)
        group, manifest, buckets = self.group, self.manifest, self.buckets
        corrupt = _mismatched(self.sums)
        if corrupt:
            raise ChecksumError(
                f"group {group.name!r} rank {group.rank}: policy_version={manifest.policy_version} rejected: "
                f"checksum mismatch in {len(corrupt)} of {len(buckets)} buckets (first {corrupt[:5]}); "
                "nothing loaded"
            )
        if self.staged or rest:
            self.load_fn(self.staged + rest)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        seconds = time.perf_counter() - self.t0
        loaded = time.time()
        stats = ReceiveStats(bytes=sum(p.nbytes for p in buckets), seconds=seconds, num_buckets=len(buckets),
                             num_tensors=self.num_tensors, header_s=self.header_s,
                             header_unix_s=loaded - (seconds - self.header_s), wire_end_unix_s=wire_end,
                             loaded_unix_s=loaded, posted_unix_s=self.posted_unix_s)
        log.debug("[transport:%s:%d] received policy_version=%d: %d tensors in %d buckets, %.1f MiB in %.3f s",
                  group.name, group.rank, manifest.policy_version, self.num_tensors, stats.num_buckets,
                  stats.bytes / 2**20, stats.seconds)
        return stats


def _mismatched(sums: list[tuple[int, torch.Tensor, torch.Tensor]]) -> list[int]:
    """The bucket indices whose checksum (computed here, received) differ, from (index, computed,
    received) per bucket: one host read for all of them (on GPUs a read per bucket would stall the
    stream once per bucket)."""
    if not sums:
        return []
    mine, theirs = torch.stack([t for _, t, _ in sums]), torch.stack([t for _, _, t in sums])
    matched = (mine == theirs).all(dim=1).tolist()
    return [index for (index, _, _), ok in zip(sums, matched) if not ok]


def receive_delta(group: TransportGroup, manifest: Manifest, load_fn: LoadFn, image: DeltaImage,
                  device: torch.device = torch.device("cpu"), src: int = 0, verify: bool = False,
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
    if group.rank == src:
        raise ValueError(f"receive_delta runs on receivers; rank {src} is the sender")
    if go is not None:
        go(group)
    t0 = time.perf_counter()
    header = torch.zeros(4, dtype=torch.int64, device=group.device)
    group.broadcast_async(header, src, count_bytes=False).wait()
    _check_header(group, manifest, header[:3])
    header_s, base = time.perf_counter() - t0, int(header[3])
    table = torch.zeros(2 * len(manifest.buckets), dtype=torch.int64, device=group.device)
    group.broadcast_async(table, src, count_bytes=False).wait()
    forms = [(Form(f), n) for f, n in table.view(-1, 2).tolist()]
    bufs = image.buckets(manifest)
    if faults.hit("delta_image_lost"):
        image.invalidate()
    refused = base != 0 and image.version != base
    held, image.version = image.version, None  # rewritten from here on
    posted: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    ops = []
    for plan, buf, (form, changed) in zip(manifest.buckets, bufs, forms):
        if form is Form.SAME:
            posted.append((None, None))
            continue
        payload = buf if form is Form.DENSE else torch.empty(
            payload_bytes(form, plan.numel, changed, buf.element_size()), dtype=torch.uint8, device=device)
        ops.append(group.broadcast_async(payload, src))
        checksum = torch.zeros(2, dtype=torch.int64, device=device) if verify else None
        if verify:
            ops.append(group.broadcast_async(checksum, src, count_bytes=False))
        posted.append((payload, checksum))
    posted_unix_s = time.time()
    for op in ops:
        op.wait()
    wire_end = time.time()
    faults.hit("receive_bucket")
    if refused:
        raise DeltaRefused(f"group {group.name!r} rank {group.rank}: policy_version={manifest.policy_version} was "
                           f"sent as changes to version {base}, this receiver holds "
                           f"{'none' if held is None else f'version {held}'}; nothing loaded, a dense sync is needed")
    sums = []
    for plan, buf, (form, changed), (payload, checksum) in zip(manifest.buckets, bufs, forms, posted):
        if form in (Form.INDEX, Form.MASK):
            apply(buf, form, changed, payload)
        if checksum is not None:
            sums.append((plan.index, bucket_checksum(buf), checksum))
    corrupt = _mismatched(sums)
    if corrupt:
        raise ChecksumError(f"group {group.name!r} rank {group.rank}: policy_version={manifest.policy_version} "
                            f"rejected: checksum mismatch in {len(corrupt)} of {len(bufs)} buckets (first "
                            f"{corrupt[:5]}); nothing loaded")
    changed_names = {e.name for plan, (form, _) in zip(manifest.buckets, forms) if form is not Form.SAME
                     for e in plan.entries}
    reassembler, num_tensors = Reassembler(manifest, device=device), 0
    for plan, buf in zip(manifest.buckets, bufs):
        done = [(n, t) for n, t in reassembler.feed(plan, buf) if base == 0 or load_unchanged or n in changed_names]
        if done:
            load_fn(done)
            num_tensors += len(done)
    rest = reassembler.finish()
    if rest and (base == 0 or load_unchanged):
        load_fn(rest)
        num_tensors += len(rest)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    image.version = manifest.policy_version
    seconds = time.perf_counter() - t0
    wire = sum(p.numel() * p.element_size() for p, _ in posted if p is not None)
    log.debug("[transport:%s:%d] received policy_version=%d against %s: %d tensors loaded, %.2f MiB in %.3f s",
              group.name, group.rank, manifest.policy_version, base or "nothing (dense)", num_tensors,
              wire / 2**20, seconds)
    loaded = time.time()
    return ReceiveStats(bytes=wire, seconds=seconds, num_buckets=len(bufs), num_tensors=num_tensors,
                        header_s=header_s, header_unix_s=loaded - (seconds - header_s), wire_end_unix_s=wire_end,
                        loaded_unix_s=loaded, posted_unix_s=posted_unix_s)


def _check_header(group: TransportGroup, manifest: Manifest, header: torch.Tensor) -> None:
    got, want = header.tolist(), header_for(manifest)
    if got != want:
        fields = ("policy_version", "num_buckets", "layout crc")
        diffs = ", ".join(f"{f} sender={g} receiver={w}" for f, g, w in zip(fields, got, want) if g != w)
        raise TransportError(
            f"group {group.name!r} rank {group.rank}: the sender's manifest does not match this "
            f"receiver's ({diffs}); refusing to load"
        )


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
