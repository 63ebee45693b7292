"""Exact delta encoding of a bucket (disagg/transport/delta.py): every form gives back the new
bucket bit for bit, is chosen by its size on the wire, and refuses a payload of the wrong size."""

from __future__ import annotations

import pytest
import torch

from disagg.transport.delta import Form, apply, changed_mask, choose_form, encode, payload_bytes


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _step(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``base`` with about ``fraction`` of its elements moved, as a small optimizer step would."""
    g = torch.Generator().manual_seed(seed)
    moved = torch.rand(base.numel(), generator=g) < fraction
    new = base.clone()
    new[moved] = (base[moved].float() * 1.01 + 1e-3).to(base.dtype)
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction, form", [(0.0, Form.SAME), (0.004, Form.INDEX), (0.2, Form.MASK),
                                            (0.97, Form.DENSE)])
def test_each_form_rebuilds_the_new_bucket_bit_for_bit(dtype, fraction, form):
    base = torch.randn(10_003, generator=torch.Generator().manual_seed(0)).to(dtype)
    new = _step(base, fraction, seed=1)
    d = encode(new, base)
    assert d.form is form, (d.form, d.changed)
    assert d.changed == int((_bits(new) != _bits(base)).sum())
    assert d.nbytes == (payload_bytes(form, new.numel(), d.changed, new.element_size()) if form is not Form.DENSE
                        else 0)
    got = base.clone()
    apply(got, d.form, d.changed, new if d.form is Form.DENSE else d.payload)
    assert torch.equal(_bits(got), _bits(new))


def test_signed_zeros_and_nans_are_compared_by_their_bits():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.0, 3.5], dtype=torch.bfloat16)
    new_bits = new.view(torch.int16).clone()
    new_bits[2] = base.view(torch.int16)[2] ^ 1  # another NaN payload: a different value to the receiver
    new = new_bits.view(torch.bfloat16)
    assert changed_mask(new, base).tolist() == [True, False, True, False, True]
    d = encode(new, base)
    got = base.clone()
    apply(got, d.form, d.changed, new if d.form is Form.DENSE else d.payload)
    assert torch.equal(got.view(torch.int16), new.view(torch.int16))


def test_the_form_is_the_smallest_on_the_wire():
    n, item = 4096, 2
    for changed in range(0, n + 1, 37):
        f = choose_form(n, changed, item)
        sizes = {g: payload_bytes(g, n, changed, item) for g in (Form.INDEX, Form.MASK, Form.DENSE)}
        assert f is Form.SAME if changed == 0 else sizes[f] == min(sizes.values()), (changed, f, sizes)
    # bf16: index lists up to 1/32 of the elements, a bit mask beyond, dense past 15/16
    assert choose_form(n, n // 32 - 1, item) is Form.INDEX and choose_form(n, n // 32 + 1, item) is Form.MASK
    assert choose_form(n, n * 15 // 16 - 1, item) is Form.MASK and choose_form(n, n * 15 // 16 + 1, item) is Form.DENSE
    assert choose_form(2**31, 10, 1) is Form.MASK  # positions past int32: no index list


def test_force_dense_skips_the_comparison_and_a_wrong_payload_size_is_refused():
    base = torch.zeros(100, dtype=torch.bfloat16)
    new = _step(base, 0.02, seed=2)
    assert encode(new, base, force_dense=True).form is Form.DENSE
    d = encode(new, base)
    assert d.form is Form.INDEX
    with pytest.raises(ValueError, match="INDEX payload of .* bytes for a bucket of 100 elements"):
        apply(base.clone(), d.form, d.changed, d.payload[:-2])
    with pytest.raises(ValueError, match="delta of a torch.bfloat16 x \\(100,\\) bucket against a base of "
                                         "torch.float32"):
        encode(new, base.float())


class _Syncs:
    """Syncs chosen by a ``DeltaChooser``, each taking the seconds given; an estimate (seconds, share)
    is given when the chooser asks for one."""

    def __init__(self, **kw) -> None:
        from disagg.transport.delta import DeltaChooser

        self.c, self.chosen = DeltaChooser(**kw), []

    def __call__(self, dense_s: float, delta_s: float, share: float = 0.05, estimate: float | None = None) -> None:
        delta, estimating = self.c.delta_next(), self.c.estimating
        self.chosen.append("delta" if delta else "dense")
        self.c.record(delta, delta_s if delta else dense_s, share if delta else 1.0,
                      estimate=(estimate, share) if estimating and estimate is not None else None)

    def deltas(self) -> list[int]:
        return [i for i, kind in enumerate(self.chosen) if kind == "delta"]


def test_auto_never_sends_a_delta_where_its_estimate_cannot_beat_dense():
    # NVLink: encoding a delta (predicted from one bucket) takes longer than the whole dense sync
    sync = _Syncs()
    for _ in range(200):
        sync(0.015, 0.045, estimate=0.030)
    assert sync.deltas() == []
    # the link slows (dense 0.5 s): at the next retry the delta is predicted to win, is sent, and wins
    for _ in range(20):
        sync(0.5, 0.045, estimate=0.030)
    assert sync.deltas()[0] >= 200 and sync.chosen[-1] == "delta"


def test_auto_on_a_slow_link_estimates_then_sends_deltas_and_retries_dense_ever_more_rarely():
    sync = _Syncs(probe_every=8, max_probe_every=512)
    for _ in range(1000):
        sync(0.66, 0.066, estimate=0.030)
    assert sync.chosen[:3] == ["dense", "dense", "delta"]  # the first sync, then the one that times the estimate
    dense = [i for i, kind in enumerate(sync.chosen) if kind == "dense"][2:]
    gaps = [b - a - 1 for a, b in zip(dense, dense[1:])]  # deltas between the dense retries, each lost
    assert dense[0] == 10 and gaps == [16, 32, 64, 128, 256], (dense, gaps)


def test_auto_with_a_wrong_estimate_or_none_measures_one_delta_and_keeps_to_what_it_measured():
    for estimate in (0.001, None):  # predicted to win but loses; no estimate given (a sender that cannot)
        sync = _Syncs()
        for _ in range(100):
            sync(0.015, 0.045, estimate=estimate)
        assert sync.deltas() == [2], estimate


def test_auto_takes_dense_when_deltas_save_little_even_if_faster_and_follows_deltas_that_get_slow():
    sync = _Syncs(probe_every=3)
    for _ in range(4):
        sync(1.0, 0.1, estimate=0.05)
    assert sync.chosen == ["dense", "dense", "delta", "delta"]
    sync.chosen.clear()
    for _ in range(3):  # deltas got slow: dense at once, and no delta while they are measured slower
        sync(0.5, 2.0)
    assert sync.chosen == ["delta", "dense", "dense"]
    sync = _Syncs(probe_every=3)
    for _ in range(6):  # nearly every value changes (a high learning rate): dense, though a delta was faster
        sync(1.0, 0.9, share=0.95, estimate=0.01)
    assert sync.chosen == ["dense", "dense", "delta", "dense", "dense", "dense"]


def test_a_dense_sync_asked_for_an_estimate_times_its_first_bucket_as_a_delta_and_keeps_the_image():
    # transport.delta=auto's estimate, on a real gloo group of one (the sender alone: the wire is not the point)
    from disagg.transport.delta import DeltaImage
    from disagg.transport.group import create_group, pick_free_port
    from disagg.transport.sender import WeightSender, build_manifest

    group = create_group(host="127.0.0.1", port=pick_free_port("127.0.0.1"), rank=0, world_size=1, backend="gloo",
                         timeout_s=30.0, group_name="estimate", device=torch.device("cpu"))
    try:
        w = {"a": torch.randn(1000, 100), "b": torch.randn(5000)}
        m = build_manifest(w.items(), 1 << 16, 1, "bfloat16")  # bucket 0: the first 32768 elements of a
        sender, image = WeightSender(group), DeltaImage()
        assert sender.send_delta(m, image, w, estimate=True).estimate is None  # nothing held to compare with
        w["a"][:10] += 1.0  # 1000 elements of bucket 0
        st = sender.send_delta(m.with_version(2), image, w, dense=True, estimate=True)
        assert st.delta_base == 0 and st.bytes == st.dense_bytes and image.version == 2
        seconds, share = st.estimate
        assert seconds > 0 and share == pytest.approx(1000 * (4 + 2) / 2**16)  # an index list of bucket 0
        w["a"][10:20] += 1.0
        st = sender.send_delta(m.with_version(3), image, w)  # the image followed the dense sync
        assert st.delta_base == 2 and st.changed_fraction == pytest.approx(1000 / 105000) and st.estimate is None
    finally:
        group.destroy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_marked_encoding_in_two_passes_gives_the_same_forms_and_payloads(dtype):
    from disagg.transport.delta import encode_marked, mark

    gen = torch.Generator().manual_seed(3)
    forms = set()
    for numel in (1, 7, 4099, 100_000):
        for share in (0.0, 0.001, 0.05, 0.3, 1.0):
            base = (torch.randn(numel, generator=gen) * 100).to(dtype)
            new = base.clone()
            moved = torch.rand(numel, generator=gen) < share
            new[moved] = (new[moved].float() * 1.5 + 1).to(dtype)
            want = encode(new, base)
            bits, count = mark(new, base)
            base.copy_(new)  # as a sender does between the passes: the image takes the new bucket
            got = encode_marked(new, bits, int(count))
            assert (got.form, got.changed) == (want.form, want.changed), (numel, share)
            assert (got.payload is None) == (want.payload is None) and (
                got.payload is None or torch.equal(got.payload, want.payload)), (numel, share)
            forms.add(got.form)
    assert forms == set(Form)  # every form was compared


def test_auto_weighs_each_kind_by_the_drivers_end_to_end_time_once_it_comes():
    # CPU loopback: a delta's send takes what a dense one does, its receivers' applying doubles it end to
    # end; told the end-to-end times (amend, before each push), the chooser keeps to dense
    from disagg.transport.delta import DeltaChooser

    def run(amended: bool) -> list[str]:
        c, chosen, last_total = DeltaChooser(), [], None
        for _ in range(12):
            if amended and last_total is not None:
                c.amend(last_total)
            delta, estimating = c.delta_next(), c.estimating
            chosen.append("delta" if delta else "dense")
            c.record(delta, 1.0 if delta else 1.05, 0.05 if delta else 1.0, estimate=(0.2, 0.05) if estimating else None)
            last_total = 2.1 if delta else 1.1  # the driver's announce -> serving
        return chosen

    assert run(amended=False)[2:] == ["delta"] * 8 + ["dense", "delta"]  # the sender alone: deltas look faster
    assert run(amended=True)[2:] == ["delta"] + ["dense"] * 9  # measured whole, one delta settles it
