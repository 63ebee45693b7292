"""Bucket planning, packing and reassembly on CPU: the layout every sync relies on."""

from __future__ import annotations

import pytest
import torch

from disagg.errors import TransportError
from disagg.transport.buckets import Reassembler, pack_bucket, torch_dtype
from disagg.transport.manifest import DTYPE_BYTES, RAMP_GROWTH, Manifest, ManifestCache, TensorSpec, plan_buckets
from disagg.transport.sender import build_manifest

# (specs, bucket_bytes): mixed dtypes, odd sizes, splits, exact fits, zero-element.
PLANNER_CASES = {
    "one_small": ([TensorSpec("a", (3,), "float32")], 64),
    "exact_fit": ([TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32")], 16),
    "odd_7x13": ([TensorSpec("w", (7, 13), "float16"), TensorSpec("b", (13,), "float16")], 50),
    "split_3_5x": ([TensorSpec("big", (56,), "float32")], 64),
    "mixed_dtypes": (
        [
            TensorSpec("f", (5, 3), "float32"),
            TensorSpec("i", (9,), "int64"),
            TensorSpec("h", (7, 13), "bfloat16"),
            TensorSpec("f2", (33,), "float32"),
            TensorSpec("e", (0, 4), "float32"),
            TensorSpec("s", (), "float16"),
        ],
        40,
    ),
    "one_element_buckets": ([TensorSpec("x", (2, 3), "int8"), TensorSpec("y", (5,), "uint8")], 1),
}


@pytest.mark.parametrize("first_bucket_bytes", [0, 8])
@pytest.mark.parametrize("case", sorted(PLANNER_CASES))
def test_planner_invariants(case: str, first_bucket_bytes: int) -> None:
    specs, bucket_bytes = PLANNER_CASES[case]
    m = plan_buckets(specs, bucket_bytes, policy_version=3, first_bucket_bytes=first_bucket_bytes)
    spec_by_name = {s.name: s for s in specs}
    coverage = {s.name: [0] * s.numel for s in specs}
    order: list[str] = []
    for i, b in enumerate(m.buckets):
        assert b.index == i
        assert 0 < b.nbytes <= bucket_bytes
        assert sum(e.numel for e in b.entries) == b.numel
        fill = 0
        for e in b.entries:
            assert spec_by_name[e.name].dtype == b.dtype  # single dtype per bucket
            assert e.bucket_offset == fill  # entries are packed densely, in order
            fill += e.numel
            for k in range(e.tensor_offset, e.tensor_offset + e.numel):
                coverage[e.name][k] += 1
            if not order or order[-1] != e.name:
                order.append(e.name)
    for name, counts in coverage.items():
        assert all(c == 1 for c in counts), f"{name}: elements not covered exactly once"
    # Within a dtype, tensors appear in the order given.
    for dt in {s.dtype for s in specs}:
        expected = [s.name for s in specs if s.dtype == dt and s.numel]
        assert [n for n in order if spec_by_name[n].dtype == dt] == expected
    assert m.total_bytes == sum(s.nbytes for s in specs)
    assert sum(b.nbytes for b in m.buckets) == m.total_bytes


@pytest.mark.parametrize("case", sorted(PLANNER_CASES))
def test_a_tensor_that_fits_a_bucket_is_never_split(case: str) -> None:
    specs, bucket_bytes = PLANNER_CASES[case]
    m = plan_buckets(specs, bucket_bytes, policy_version=0)
    parts: dict[str, list[int]] = {}
    for b in m.buckets:
        for e in b.entries:
            parts.setdefault(e.name, []).append(b.index)
    for s in specs:
        if 0 < s.nbytes <= bucket_bytes:
            assert len(parts[s.name]) == 1, (s, parts[s.name])
        elif s.nbytes > bucket_bytes:
            # Split into full buckets, the first part opening a bucket of its own.
            first = m.buckets[parts[s.name][0]]
            assert first.entries[0].name == s.name and first.entries[0].tensor_offset == 0
            assert len(parts[s.name]) == -(-s.nbytes // bucket_bytes)


def _ramp_sizes(first: int, bucket_bytes: int, total: int, tensor_bytes: int) -> list[int]:
    """The bucket sizes a ramp gives ``total`` bytes of equal float32 tensors of ``tensor_bytes``."""
    n = total // tensor_bytes
    specs = [TensorSpec(f"t{i}", (tensor_bytes // 4,), "float32") for i in range(n)]
    m = plan_buckets(specs, bucket_bytes, policy_version=0, first_bucket_bytes=first)
    assert m.first_bucket_bytes == first
    return [b.nbytes for b in m.buckets]


def test_the_buckets_ramp_up_from_the_first_size_and_back_down_to_it() -> None:
    kib = 1024
    sizes = _ramp_sizes(4 * kib, 64 * kib, 1024 * kib, kib)  # 1 MiB of 1 KiB tensors, 64 KiB buckets
    # up: each limit RAMP_GROWTH times the one before, from the first size to the full one
    assert sizes[:3] == [4 * kib, 4 * kib * RAMP_GROWTH, 4 * kib * RAMP_GROWTH**2]
    assert sizes[3] == 64 * kib
    # down: each bucket at most (g - 1) / g of what is left, so the last ones shrink to the first size
    left = sum(sizes)
    for size in sizes:
        assert size <= max(4 * kib, -(-left * (RAMP_GROWTH - 1) // RAMP_GROWTH))
        left -= size
    assert sizes[-1] <= 4 * kib and sizes[-2] < sizes[-3] < 64 * kib
    assert sum(sizes) == 1024 * kib and max(sizes) == 64 * kib
    # no more than a few buckets beyond the plan without a ramp (16 full ones)
    assert len(_ramp_sizes(0, 64 * kib, 1024 * kib, kib)) == 16 < len(sizes) <= 16 + 8


@pytest.mark.parametrize("first", [0, 64 * 1024, 1 << 20])
def test_a_ramp_from_a_full_bucket_or_none_plans_full_buckets(first: int) -> None:
    plain = plan_buckets([TensorSpec("w", (50_000,), "float32")], 64 * 1024, 1)
    ramped = plan_buckets([TensorSpec("w", (50_000,), "float32")], 64 * 1024, 1, first_bucket_bytes=first)
    assert ramped.buckets == plain.buckets and ramped.first_bucket_bytes == 0


def test_a_negative_first_bucket_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="first_bucket_bytes must be >= 0.*-1"):
        plan_buckets([TensorSpec("w", (5,), "float32")], 64, 1, first_bucket_bytes=-1)


def test_planner_closes_a_bucket_rather_than_split_a_tensor_that_fits() -> None:
    specs = [TensorSpec("a", (3,), "float32"), TensorSpec("b", (3,), "float32"), TensorSpec("c", (1,), "float32")]
    m = plan_buckets(specs, 16, policy_version=0)  # 4 floats per bucket: a | b c
    assert [[e.name for e in b.entries] for b in m.buckets] == [["a"], ["b", "c"]]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)


def _round_trip(tensors: dict[str, torch.Tensor], manifest: Manifest) -> dict[str, torch.Tensor]:
    reasm = Reassembler(manifest)
    got: dict[str, torch.Tensor] = {}
    for plan in manifest.buckets:
        buf = pack_bucket(plan, tensors)
        for name, t in reasm.feed(plan, buf):
            assert name not in got, f"{name} emitted twice"
            got[name] = t.clone()
    for name, t in reasm.finish():
        got[name] = t
    return got


def test_pack_reassemble_round_trip_mixed_dtypes() -> None:
    gen = torch.Generator().manual_seed(0)
    bucket_bytes = 256
    tensors = {
        "f32_odd": _random((7, 13), torch.float32, gen),
        "bf16": _random((3, 5), torch.bfloat16, gen),
        "f16": _random((11,), torch.float16, gen),
        "i64": _random((6,), torch.int64, gen),
        "big": _random((224,), torch.float32, gen),  # 896 bytes: 3.5 buckets
        "empty": torch.empty(0, 5),
        "scalar": _random((), torch.float32, gen),
        "non_contig": _random((8, 6), torch.float32, gen).t(),
    }
    manifest = build_manifest(tensors.items(), bucket_bytes, policy_version=1)
    assert manifest.spec("big").nbytes == 3.5 * bucket_bytes
    assert sum(1 for b in manifest.buckets for e in b.entries if e.name == "big") >= 4
    got = _round_trip(tensors, manifest)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_single_bucket_tensors_are_views_and_split_tensors_are_fresh() -> None:
    tensors = {"small": torch.arange(6.0).reshape(2, 3), "big": torch.arange(40.0)}
    manifest = build_manifest(tensors.items(), bucket_bytes=64, policy_version=0)
    reasm = Reassembler(manifest)
    buffers = []
    emitted = {}
    for plan in manifest.buckets:
        buf = pack_bucket(plan, tensors)
        buffers.append(buf)
        for name, t in reasm.feed(plan, buf):
            emitted[name] = (t, buf)
    small, small_buf = emitted["small"]
    assert small.untyped_storage().data_ptr() == small_buf.untyped_storage().data_ptr()
    big, _ = emitted["big"]
    assert all(big.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() for b in buffers)
    assert torch.equal(big, tensors["big"])
    reasm.finish()


def test_split_tensors_a_part_loader_takes_arrive_as_parts_never_assembled() -> None:
    """With ``parts``, a split tensor it names goes to it part by part (views of each bucket's
    buffer, with their element offsets, the last one flagged); the rest are emitted as before."""
    from disagg.transport.buckets import PartLoader

    tensors = {"small": torch.arange(6.0).reshape(2, 3), "big": torch.arange(40.0), "other": torch.arange(30.0) + 100}
    manifest = build_manifest(tensors.items(), bucket_bytes=64, policy_version=0)
    got: list[tuple[str, int, bool, bool]] = []
    into = torch.zeros(40)

    def load(name: str, part: torch.Tensor, offset: int, last: bool) -> None:
        got.append((name, offset, last, part.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()))
        into[offset : offset + part.numel()] = part

    reasm = Reassembler(manifest, parts=PartLoader(frozenset({"big"}), load))
    emitted = {}
    for plan in manifest.buckets:
        buf = pack_bucket(plan, tensors)
        for name, t in reasm.feed(plan, buf):
            emitted[name] = t.clone()
    reasm.finish()  # every tensor complete, the parts' too
    assert set(emitted) == {"small", "other"} and torch.equal(emitted["other"], tensors["other"])
    assert torch.equal(into, tensors["big"])
    assert [g[0] for g in got] == ["big"] * len(got) and len(got) >= 3  # split: 160 bytes in 64-byte buckets
    assert [g[1] for g in got] == sorted(g[1] for g in got) and got[0][1] == 0
    assert [g[2] for g in got] == [False] * (len(got) - 1) + [True]
    assert all(g[3] for g in got)  # views of the bucket's buffer, not copies


def test_pack_casts_to_the_plan_dtype() -> None:
    src = {"w": torch.randn(5, 7, dtype=torch.float32), "steps": torch.arange(4)}
    manifest = build_manifest(src.items(), bucket_bytes=1 << 10, policy_version=0, dtype_override="bfloat16")
    assert manifest.spec("w").dtype == "bfloat16" and manifest.spec("steps").dtype == "int64"
    got = _round_trip(src, manifest)
    assert got["w"].dtype == torch.bfloat16
    assert torch.equal(got["w"], src["w"].to(torch.bfloat16))
    assert torch.equal(got["steps"], src["steps"])


def test_finish_raises_when_a_bucket_is_missing() -> None:
    tensors = {"a": torch.arange(30.0)}
    manifest = build_manifest(tensors.items(), bucket_bytes=32, policy_version=5)
    reasm = Reassembler(manifest)
    first = manifest.buckets[0]
    assert reasm.feed(first, pack_bucket(first, tensors)) == []
    with pytest.raises(TransportError, match="'a'"):
        reasm.finish()


def test_manifest_of_only_empty_tensors_emits_them_at_finish() -> None:
    manifest = build_manifest([("e", torch.empty(0, 3, dtype=torch.int64))], 64, policy_version=0)
    assert manifest.buckets == ()
    (name, t), = Reassembler(manifest).finish()
    assert name == "e" and t.shape == (0, 3) and t.dtype == torch.int64


def test_manifest_dict_round_trip_and_digest() -> None:
    specs = [TensorSpec("a", (7, 13), "float32"), TensorSpec("b", (5,), "bfloat16"), TensorSpec("c", (0,), "int64")]
    m = plan_buckets(specs, 48, policy_version=9)
    again = Manifest.from_dict(m.to_dict())
    assert again == m
    assert again.layout_digest() == m.layout_digest()
    assert m.with_version(10).layout_digest() == m.layout_digest()
    reshaped = plan_buckets([TensorSpec("a", (13, 7), "float32")] + specs[1:], 48, policy_version=9)
    assert reshaped.layout_digest() != m.layout_digest()
    retyped = plan_buckets([specs[0], TensorSpec("b", (5,), "float16"), specs[2]], 48, policy_version=9)
    assert retyped.layout_digest() != m.layout_digest()


def test_a_held_manifest_answers_its_own_digest_at_any_version_and_nothing_else() -> None:
    specs = [TensorSpec("a", (7, 13), "float32"), TensorSpec("b", (5,), "bfloat16")]
    m = plan_buckets(specs, 48, policy_version=3)
    other = plan_buckets([TensorSpec("a", (13, 7), "float32"), specs[1]], 48, policy_version=3)
    cache = ManifestCache()
    # nothing held: nothing answered, whatever is asked
    assert cache.held is None and cache.digest is None and cache.at(4) is None
    assert not cache.holds(m.layout_digest()) and cache.by_digest(m.layout_digest(), 4) is None
    assert cache.hold(m) is m and cache.held is m and cache.digest == m.layout_digest()
    # the held layout, named by its digest, at a new version: the same layout, its digest carried over
    again = cache.by_digest(m.layout_digest(), 7)
    assert again.policy_version == 7 and again.layout_digest() == m.layout_digest() and "_digest" in again.__dict__
    assert (again.tensors, again.buckets, again.bucket_bytes) == (m.tensors, m.buckets, m.bucket_bytes)
    assert cache.at(8).policy_version == 8 and cache.at(8).layout_digest() == m.layout_digest()
    assert cache.held is m  # answering re-versions a copy; what is held stays as it was held
    # another layout's digest, or none named, is not answered from the cache
    assert not cache.holds(other.layout_digest()) and cache.by_digest(other.layout_digest(), 7) is None
    assert not cache.holds(None) and cache.by_digest(None, 7) is None and not cache.holds("")
    # holding another replaces it; forgetting holds nothing
    cache.hold(other)
    assert cache.holds(other.layout_digest()) and cache.by_digest(m.layout_digest(), 9) is None
    cache.forget()
    assert cache.held is None and cache.at(9) is None and cache.by_digest(other.layout_digest(), 9) is None
    # the holder whose layout it is: made once, at the first ask, then held
    made = []
    first = cache.made_at(5, lambda: made.append(1) or m)
    assert first.policy_version == 5 and cache.held is m and made == [1]
    assert cache.made_at(6, lambda: made.append(1) or other).layout_digest() == m.layout_digest() and made == [1]


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_dtype_table_matches_torch(dtype: str) -> None:
    assert torch.empty(0, dtype=torch_dtype(dtype)).element_size() == DTYPE_BYTES[dtype]


def test_layout_mismatch_names_each_disagreement():
    from disagg.transport.manifest import TensorSpec, layout_mismatch

    model = [TensorSpec("a.weight", (4, 8), "float32"), TensorSpec("b.weight", (8,), "float32")]
    assert layout_mismatch([TensorSpec("a.weight", (4, 8), "bfloat16"), TensorSpec("b.weight", (8,), "float16")],
                           model) == []  # a floating tensor may travel in another floating dtype
    problems = layout_mismatch([TensorSpec("a.weight", (8, 4), "float32"), TensorSpec("c.bias", (2,), "float32"),
                                TensorSpec("b.weight", (8,), "int64")], model)
    assert "'c.bias' is not a parameter of the model" in problems
    assert "'a.weight' has shape (8, 4), the model's is (4, 8)" in problems
    assert "'b.weight' is int64, the model's is float32" in problems
    many = layout_mismatch([TensorSpec(f"x{i}", (1,), "float32") for i in range(9)], model, limit=3)
    assert len(many) == 4 and many[-1] == "... 8 more"
