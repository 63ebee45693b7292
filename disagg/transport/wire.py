"""What a weight sync puts on the wire besides the buckets: the header and a delta's table.

Both sides import it (``sender.py`` writes, ``receiver.py`` reads), so a trainer and an engine of
different commits speak the same words as long as this file's layout stands:

- dense: ``[policy_version, num_buckets, layout crc]`` (int64), then the buckets;
- delta: the same three numbers and the version the delta was made against (0: dense), then a table
  of ``(form, changed elements)`` per bucket (``delta.Form``), then one payload per bucket that
  changed;
- with ``transport.verify``, each bucket (or payload) is followed by the bucket's checksum
  (``buckets.bucket_checksum``: two int64).

Rank 0 of every transport group is its source (``SOURCE``): trainer rank r sends over its own
group as that group's rank 0. This module never communicates and never imports vLLM or Ray.
"""

from __future__ import annotations

import zlib

import torch

from disagg.errors import TransportError
from disagg.transport.delta import Form
from disagg.transport.group import TransportGroup
from disagg.transport.manifest import Manifest

SOURCE = 0  # the rank that sends over a transport group
HEADER_INTS = 3  # a dense header: header_for's three numbers
DELTA_HEADER_INTS = HEADER_INTS + 1  # a delta's: and its base version
CHECKSUM_INTS = 2  # bucket_checksum: plain and position-weighted sums


def header_for(manifest: Manifest) -> list[int]:
    """The int64 header sent before the buckets: [policy_version, num_buckets, layout crc]."""
    return [manifest.policy_version, len(manifest.buckets), zlib.crc32(manifest.layout_digest().encode())]


def delta_header(manifest: Manifest, base: int | None) -> list[int]:
    """A delta sync's header: ``header_for`` and the version it was made against (None: dense, sent as 0)."""
    return [*header_for(manifest), base or 0]


def table_for(forms: list[tuple[Form, int]]) -> list[int]:
    """A delta sync's table: each bucket's form and changed elements, flat."""
    return [x for form, changed in forms for x in (int(form), changed)]


def read_table(table: torch.Tensor) -> list[tuple[Form, int]]:
    """``table_for``'s numbers as received: (form, changed elements) per bucket."""
    return [(Form(f), n) for f, n in table.view(-1, 2).tolist()]


def ints_on(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, queued there without the host waiting. A plain
    ``torch.tensor(values, device=cuda)`` copies from pageable memory, and torch then synchronizes
    the stream: the header of a push waited for every kernel queued before it (a step's optimizer,
    a snapshot's copies) before its broadcast was even posted. From pinned memory the copy is
    queued like a kernel (torch keeps the pinned block until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def check_header(group: TransportGroup, manifest: Manifest, header: torch.Tensor) -> None:
    """Raise ``TransportError`` naming each number where the sender's header (its first three) and
    ``manifest`` disagree: nothing of a version planned from another manifest may be loaded."""
    got, want = header[:HEADER_INTS].tolist(), header_for(manifest)
    if got != want:
        fields = ("policy_version", "num_buckets", "layout crc")
        diffs = ", ".join(f"{f} sender={g} receiver={w}" for f, g, w in zip(fields, got, want) if g != w)
        raise TransportError(
            f"group {group.name!r} rank {group.rank}: the sender's manifest does not match this "
            f"receiver's ({diffs}); refusing to load"
        )
