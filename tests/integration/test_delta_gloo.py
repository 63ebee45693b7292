"""Delta syncs over a real gloo group between spawned processes (disagg/transport/delta.py,
``WeightSender.send_delta``, ``receive_delta``).

Rank 0 sends five syncs to ranks 1 and 2, each holding its own image: version 1 dense (no image
yet), version 2 with about 1 % of the floating-point elements changed, version 3 unchanged,
version 4 with about 30 % changed while rank 2 has dropped its image (it refuses the delta and
keeps version 3), then version 4 again dense. Every loaded model must equal the sender's tensors
bit for bit, and the bytes on the wire must follow what changed.
"""

from __future__ import annotations

import time

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


def _armed_delta(rank: int, world: int, port: int) -> dict:
    """Armed deltas, a delta called off in its word, and a corrupt delta refused by its checksums:
    version 1 dense; 2 as an armed delta (the word a second after the push set up); 3 called off in
    its word, then sent armed (a delta onto 2: the call-off left both images alone); 4 verified with
    one bucket's checksum wrong (refused: the receiver's image then holds none), then 4 again dense."""
    import disagg.transport.sender as sending
    from disagg.errors import ChecksumError, SyncCancelled
    from disagg.transport.model_transfer import ARM_CANCEL, ARM_SEND, arm_key, armed_go

    group = _group(rank, world, port, timeout_s=30.0)
    weights = {1: _version(1), 2: _version(2), 3: _version(4), 4: _version(2)}
    try:
        if rank == 0:
            sender, checked, image, facts = WeightSender(group), WeightSender(group, verify=True), DeltaImage(), {}
            m = build_manifest(weights[1].items(), BUCKET_BYTES, policy_version=1)
            sender.send_delta(m, image, weights[1])
            went: dict = {}

            def go() -> None:
                time.sleep(1.0)
                went["unix_s"] = time.time()
                group.signal(arm_key(31), ARM_SEND)

            def off() -> None:
                raise SyncCancelled("the driver called it off")

            s2 = sender.send_delta(m.with_version(2), image, weights[2], go=go)
            facts["v2"] = {"base": s2.delta_base, "planned_before_go": s2.stamps["planned"] < went["unix_s"],
                           "header_after_go": s2.stamps["header_copied"] >= went["unix_s"]
                           and s2.header_unix_s >= went["unix_s"], "seconds": s2.seconds, "bytes": s2.bytes,
                           "dense_bytes": s2.dense_bytes}
            try:
                sender.send_delta(m.with_version(3), image, weights[3], go=off)
            except SyncCancelled as e:
                facts["off"], facts["image_after_off"] = str(e), image.version
            group.signal(arm_key(32), ARM_CANCEL)
            facts["v3_base"] = sender.send_delta(m.with_version(3), image, weights[3],
                                                 go=lambda: group.signal(arm_key(33), ARM_SEND)).delta_base
            real, calls = sending.bucket_checksum, []

            def one_wrong(buf: torch.Tensor) -> torch.Tensor:
                calls.append(1)
                return real(buf) + (1 if len(calls) == 1 else 0)

            sending.bucket_checksum = one_wrong
            try:
                facts["corrupt_base"] = checked.send_delta(m.with_version(4), image, weights[4]).delta_base
            finally:
                sending.bucket_checksum = real
            image.invalidate()  # as the driver does once a sync failed: the next goes dense
            facts["again_base"] = checked.send_delta(m.with_version(4), image, weights[4]).delta_base
            return facts
        net, image, out = _zeroed_net(), DeltaImage(), {}
        load_fn = TorchModelReceiver.load_into_module(net)
        manifest = build_manifest(net.state_dict().items(), BUCKET_BYTES, policy_version=1)

        def holds(v: int) -> bool:
            got = net.state_dict()
            return all(torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)) for k, t in weights[v].items())

        receive_delta(group, manifest, load_fn, image)
        t0 = time.monotonic()
        st = receive_delta(group, manifest.with_version(2), load_fn, image, go=armed_go(31, 30.0, "armed delta 31"))
        out["v2"] = {"waited_s": time.monotonic() - t0, "bytes": st.bytes, "holds": holds(2), "image": image.version}
        try:
            receive_delta(group, manifest.with_version(3), load_fn, image, go=armed_go(32, 30.0, "armed delta 32"))
        except SyncCancelled as e:
            out["off"], out["off_holds"], out["off_image"] = str(e), holds(2), image.version
        receive_delta(group, manifest.with_version(3), load_fn, image, go=armed_go(33, 30.0, "armed delta 33"))
        out["v3"] = {"holds": holds(3), "image": image.version}
        try:
            receive_delta(group, manifest.with_version(4), load_fn, image, verify=True)
        except ChecksumError as e:
            out["corrupt"], out["corrupt_holds"], out["corrupt_image"] = str(e), holds(3), image.version
        st = receive_delta(group, manifest.with_version(4), load_fn, image, verify=True)
        out["again"] = {"holds": holds(4), "image": image.version, "tensors": st.num_tensors,
                        "num_entries": len(net.state_dict())}
        return out
    finally:
        group.destroy()


def test_an_armed_delta_waits_for_the_word_a_called_off_one_keeps_both_images_and_a_corrupt_one_is_refused() -> None:
    reports, _ = _spawn(_armed_delta, world=2, ranks=[0, 1])
    tx, rx = reports[0], reports[1]
    assert tx["ok"] and rx["ok"], reports
    # armed: packed and compared after the word (the delta's header with it), the wait not in its seconds
    v2 = tx["v2"]
    assert v2["base"] == 1 and v2["planned_before_go"] and v2["header_after_go"] and v2["seconds"] < 0.9, v2
    assert 0 < v2["bytes"] < 0.1 * v2["dense_bytes"], v2
    assert rx["v2"]["waited_s"] >= 0.9 and rx["v2"]["holds"] and rx["v2"]["image"] == 2, rx
    assert rx["v2"]["bytes"] == v2["bytes"], rx
    # called off in its word: nothing on the wire, both images still on version 2, the next a delta onto it
    assert tx["off"] == "the driver called it off" and tx["image_after_off"] == 2, tx
    assert "called off by the sender" in rx["off"] and rx["off_holds"] and rx["off_image"] == 2, rx
    assert tx["v3_base"] == 2 and rx["v3"] == {"holds": True, "image": 3}, (tx, rx)
    # one bucket's checksum wrong: refused after the wire, nothing loaded, the image holding none
    assert tx["corrupt_base"] == 3 and "checksum mismatch in 1 of" in rx["corrupt"], (tx, rx)
    assert rx["corrupt_holds"] and rx["corrupt_image"] is None, rx
    # the version again, dense: every tensor loaded
    assert tx["again_base"] == 0 and rx["again"]["holds"] and rx["again"]["image"] == 4, (tx, rx)
    assert rx["again"]["tensors"] == rx["again"]["num_entries"], rx
