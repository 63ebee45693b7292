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


def test_auto_starts_dense_tries_a_delta_takes_the_faster_and_tries_the_other_again_later():
    from disagg.transport.delta import DeltaChooser

    c = DeltaChooser(probe_every=3)
    chosen = []

    def sync(dense_s: float, delta_s: float, share: float = 0.05) -> None:
        delta = c.delta_next()
        chosen.append("delta" if delta else "dense")
        c.record(delta, delta_s if delta else dense_s, share if delta else 1.0)

    sync(3.0, 0.1)  # nothing measured: dense (a first sync, slow with its set-up)
    sync(1.0, 0.1)  # dense measured, delta not yet: a delta
    for _ in range(5):  # 10x faster: deltas, and after 3 in a row dense again (its first time was inflated)
        sync(1.0, 0.1)
    assert chosen == ["dense", "delta", "delta", "delta", "dense", "delta", "delta"]
    chosen.clear()
    # deltas got slow (a fast link): dense; the dense retry above lost, so the next delta comes
    # after 6 dense in a row, not 3, and it losing too doubles the wait again (12)
    for _ in range(21):
        sync(0.5, 2.0)
    assert [i for i, kind in enumerate(chosen) if kind == "delta"] == [0, 7, 20]
    chosen.clear()
    for _ in range(30):  # deltas fast again: found at the next retry (after 24), which wins and resets the wait to 3
        sync(0.5, 0.1)
    assert chosen == ["dense"] * 24 + ["delta"] * 3 + ["dense"] + ["delta"] * 2  # (that dense retry lost: next after 6)
    chosen.clear()
    for _ in range(5):  # nearly every value changes (a high learning rate): dense even where a delta was faster
        sync(1.0, 0.9, share=0.95)
    assert chosen[:3] == ["delta", "dense", "dense"]  # the delta measured 95 % of the bytes: dense, though faster


def test_auto_retries_a_losing_kind_ever_more_rarely():
    # a delta 3x slower than dense on every sync (NVLink): the retries come after 8, 16, 32 ... dense
    # syncs in a row, so over 1000 syncs 7 deltas are sent, not 1000 / 9
    from disagg.transport.delta import DeltaChooser

    c, deltas = DeltaChooser(probe_every=8, max_probe_every=512), []
    for i in range(1000):
        delta = c.delta_next()
        if delta:
            deltas.append(i)
        c.record(delta, 3.0 if delta else 1.0, 0.05 if delta else 1.0)
    gaps = [b - a - 1 for a, b in zip(deltas, deltas[1:])]
    assert deltas[0] == 1 and gaps == [8, 16, 32, 64, 128, 256]
