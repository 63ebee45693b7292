"""Weight snapshots for pushes that overlap the next train step (transport.overlap_push), and the
per-token policy versions an engine reads from vLLM's weight-version spans."""

from __future__ import annotations

import pytest
import torch

from disagg.errors import TransportError
from disagg.trainer.snapshot import Snapshots
from disagg.transport.buckets import contiguous_bucket, flatten_parameters
from disagg.transport.sender import build_manifest


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False))


def _params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in m.named_parameters()}


def test_a_snapshot_keeps_the_version_it_copied_while_the_live_weights_change():
    m = _model()
    snaps = Snapshots()
    before = {n: t.clone() for n, t in _params(m).items()}
    snap = snaps.take(3, _params(m))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # the next optimizer step, in place
    assert snaps.get(3) is snap and snap.version == 3
    for n, t in snap.tensors.items():
        assert torch.equal(t, before[n]), n
        assert not torch.equal(t, dict(m.named_parameters())[n].detach()), n


def test_a_snapshot_of_flat_parameters_is_flat_so_buckets_go_out_without_packing():
    m = _model()
    flats = list(flatten_parameters(m).values())
    params = _params(m)
    snap = Snapshots().take(1, params, flats)
    manifest = build_manifest(params.items(), bucket_bytes=1 << 20, policy_version=1)
    (plan,) = manifest.buckets
    view = contiguous_bucket(plan, {e.name: snap.tensors[e.name] for e in plan.entries})
    assert view is not None  # one slice of the snapshot's flat buffer, in plan order
    assert torch.equal(view, flats[0][: plan.numel])
    assert view.data_ptr() != flats[0].data_ptr()  # a copy, not the live buffer
    assert snap.nbytes == flats[0].numel() * flats[0].element_size()


def test_two_versions_are_kept_the_oldest_slot_is_reused_and_a_missing_version_is_named():
    m = _model()
    snaps = Snapshots(keep=2)
    for v in (5, 6):
        with torch.no_grad():
            m[0].weight.fill_(float(v))
        snaps.take(v, _params(m))
    assert snaps.versions() == [5, 6]
    with torch.no_grad():
        m[0].weight.fill_(7.0)
    snaps.take(7, _params(m))
    assert snaps.versions() == [6, 7]
    assert float(snaps.get(6).tensors["0.weight"][0, 0]) == 6.0
    assert float(snaps.get(7).tensors["0.weight"][0, 0]) == 7.0
    with pytest.raises(TransportError, match=r"policy version 5 .*have \[6, 7\]"):
        snaps.get(5)


def test_parameters_replaced_by_new_tensors_get_a_fresh_layout():
    m = _model()
    snaps = Snapshots(keep=1)
    snaps.take(1, _params(m))
    m[1].weight = torch.nn.Parameter(torch.full((4, 32), 2.0))  # another shape and memory
    snap = snaps.take(2, _params(m))
    assert snap.tensors["1.weight"].shape == (4, 32)
    assert float(snap.tensors["1.weight"].sum()) == 2.0 * 4 * 32
