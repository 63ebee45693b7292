"""Delta syncs over a real gloo group between spawned processes (disagg/transport/delta.py,
``WeightSender.send_delta``, ``receive_delta``).

Rank 0 sends five syncs to ranks 1 and 2, each holding its own image: version 1 dense (no image
yet), version 2 with about 1 % of the floating-point elements changed, version 3 unchanged,
version 4 with about 30 % changed while rank 2 has dropped its image (it refuses the delta and
keeps version 3), then version 4 again dense. Every loaded model must equal the sender's tensors
bit for bit, and the bytes on the wire must follow what changed.
"""

from __future__ import annotations

import pytest
import torch

from disagg.errors import DeltaRefused
from disagg.transport.delta import DeltaImage
from disagg.transport.receiver import TorchModelReceiver, receive_delta
from disagg.transport.sender import WeightSender, build_manifest
from tests.integration.test_transport_gloo import BUCKET_BYTES, _group, _spawn, _weights, _zeroed_net


def _version(v: int) -> dict[str, torch.Tensor]:
    """The sender's tensors of version ``v``: version 1's, then a share of the floating-point
    elements moved at versions 2 (1 %) and 4 (30 %); 3 equals 2 and 5 equals 4."""
    w = _weights(7)
    for step, share in ((2, 0.01), (4, 0.30)):
        if v < step:
            break
        gen = torch.Generator().manual_seed(step)
        for name, t in w.items():
            if t.dtype.is_floating_point:
                moved = torch.rand(t.shape, generator=gen) < share
                t[moved] = (t[moved].float() * 1.5 + 0.25).to(t.dtype)
    return w


def _delta(rank: int, world: int, port: int, verify: bool) -> dict:
    group = _group(rank, world, port, timeout_s=30.0)
    try:
        if rank == 0:
            # verified: the buckets compared all at once (one host read, as on GPUs); plain: one at a time
            sender, image, stats = WeightSender(group, verify=verify, one_read=verify), DeltaImage(), []
            for v in (1, 2, 3, 4, 4):
                if len(stats) == 4:  # the second send of version 4: rank 2 refused the first
                    image.invalidate()
                w = _version(v)
                s = sender.send_delta(build_manifest(w.items(), BUCKET_BYTES, policy_version=v), image, w)
                stats.append({"bytes": s.bytes, "dense_bytes": s.dense_bytes, "base": s.delta_base,
                              "changed": s.changed_fraction})
            return {"stats": stats, "bytes_sent": group.bytes_sent}
        net, image, out = _zeroed_net(), DeltaImage(), []
        load_fn = TorchModelReceiver.load_into_module(net)
        for v in (1, 2, 3, 4, 4):
            if rank == 2 and len(out) == 3:
                image.invalidate()  # as after a failed sync: this rank holds no known version
            manifest = build_manifest(net.state_dict().items(), BUCKET_BYTES, policy_version=v)
            try:
                st = receive_delta(group, manifest, load_fn, image, verify=verify)
                entry = {"bytes": st.bytes, "tensors": st.num_tensors}
            except DeltaRefused as e:
                entry = {"refused": str(e)}
            got = net.state_dict()
            entry["equal_to"] = [u for u in (1, 2, 4) if all(torch.equal(got[k].view(torch.uint8), t.view(torch.uint8))
                                                             for k, t in _version(u).items())]  # bit for bit
            entry["image"] = image.version
            out.append(entry)
        return {"versions": out, "bytes_received": group.bytes_received, "num_entries": len(net.state_dict())}
    finally:
        group.destroy()


def _delta_verified(rank: int, world: int, port: int) -> dict:
    return _delta(rank, world, port, verify=True)


def _delta_plain(rank: int, world: int, port: int) -> dict:
    return _delta(rank, world, port, verify=False)


@pytest.mark.parametrize("target", [_delta_verified, _delta_plain], ids=["verify-one-read", "plain"])
def test_delta_syncs_rebuild_every_version_exactly_and_send_only_what_changed(target) -> None:
    reports, codes = _spawn(target, world=3, ranks=[0, 1, 2])
    assert all(reports[r]["ok"] for r in (0, 1, 2)), reports
    stats = reports[0]["stats"]
    dense = stats[0]["dense_bytes"]
    assert [s["base"] for s in stats] == [0, 1, 2, 3, 0]
    assert stats[0]["bytes"] == stats[4]["bytes"] == dense and stats[0]["changed"] is None
    # 1 % of the floats moved: index lists, a small share of the dense bytes (the int64 buffers are the same)
    assert 0.005 < stats[1]["changed"] < 0.02 and stats[1]["bytes"] < 0.1 * dense, stats[1]
    assert stats[2]["changed"] == 0.0 and stats[2]["bytes"] == 0  # nothing changed: nothing on the wire
    assert 0.2 < stats[3]["changed"] < 0.4 and stats[3]["bytes"] < 0.7 * dense, stats[3]  # bit masks
    assert reports[0]["bytes_sent"] == sum(s["bytes"] for s in stats)
    for r in (1, 2):
        got = reports[r]["versions"]
        assert reports[r]["bytes_received"] == reports[0]["bytes_sent"]
        if r == 1:
            assert [g["bytes"] for g in got] == [s["bytes"] for s in stats]
        assert got[0]["equal_to"] == [1] and got[0]["tensors"] == reports[r]["num_entries"]
        assert got[1]["equal_to"] == [2] and 0 < got[1]["tensors"] < reports[r]["num_entries"]
        assert got[2]["equal_to"] == [2] and got[2]["tensors"] == 0
        assert got[4]["equal_to"] == [4] and got[4]["image"] == 4
    assert reports[1]["versions"][3]["equal_to"] == [4]  # the delta onto the image it holds
    refused = reports[2]["versions"][3]
    assert "sent as changes to version 3, this receiver holds none" in refused["refused"], refused
    assert refused["equal_to"] == [2] and refused["image"] is None  # its weights stayed on version 3 (= 2)
