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


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64])  # one bucket; a weight split over several
def test_a_snapshot_in_the_push_layout_holds_the_wire_cast_and_every_bucket_is_a_view_of_it(bucket_bytes):
    m = _model()
    params = _params(m)  # float32, not flat: a push from them packs and casts every bucket
    manifest = build_manifest(params.items(), bucket_bytes=bucket_bytes, policy_version=1, dtype_override="bfloat16")
    assert any(contiguous_bucket(p, params) is None for p in manifest.buckets)
    snap = Snapshots().take(1, params, None, manifest.buckets)
    for n, t in params.items():
        assert snap.tensors[n].dtype == torch.bfloat16 and snap.tensors[n].shape == t.shape
        assert torch.equal(snap.tensors[n], t.to(torch.bfloat16)), n
    assert snap.nbytes == manifest.total_bytes  # the wire's bytes: half the float32 parameters'
    for plan in manifest.buckets:
        view = contiguous_bucket(plan, snap.tensors)
        assert view is not None, plan.index
        packed = torch.cat([params[e.name].reshape(-1)[e.tensor_offset : e.tensor_offset + e.numel]
                            for e in plan.entries]).to(torch.bfloat16)
        assert torch.equal(view, packed)  # what the receiver unpacks: the bucket's plan, bit for bit
    with torch.no_grad():
        m[0].weight.add_(1.0)
    snap2 = Snapshots().take(2, _params(m), None, manifest.buckets)
    assert torch.equal(snap2.tensors["0.weight"], (params["0.weight"]).to(torch.bfloat16))


def test_a_layout_whose_tensors_are_not_contiguous_back_to_back_is_copied_as_the_parameters_are():
    from disagg.trainer.snapshot import wire_offsets
    from disagg.transport.manifest import BucketEntry, BucketPlan

    m = _model()
    params = _params(m)
    plans = build_manifest(params.items(), bucket_bytes=64, policy_version=1).buckets
    assert wire_offsets(plans) is not None
    first, second = plans[0], plans[1]
    # the same tensor's parts swapped between two buckets: not one view of a back-to-back copy
    swapped = (BucketPlan(0, first.dtype, first.numel, tuple(BucketEntry(e.name, e.tensor_offset + first.numel,
                                                                          e.bucket_offset, e.numel)
                                                               for e in first.entries)), *plans[1:])
    assert first.entries[0].name == second.entries[0].name and wire_offsets(swapped) is None
    snap = Snapshots().take(1, params, None, swapped)
    assert all(snap.tensors[n].dtype == t.dtype for n, t in params.items())


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
