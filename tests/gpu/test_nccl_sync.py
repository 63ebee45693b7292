"""The model-level sync of tests/integration/test_sync_modes.py on GPUs: over NCCL, one GPU
per process (trainers first, then 2 receivers), and over gloo between processes sharing one GPU
(cluster=one_gpu). Run on the GPU machines."""

import pytest
import torch

from tests.integration.test_sync_modes import _run, check_bit_identical, check_delta

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (2, "gather"), (2, "shards")])
def test_nccl_pipelined_sync_is_bit_identical(trainers, source):
    receivers = 2 if torch.cuda.device_count() >= trainers + 2 else 1
    if torch.cuda.device_count() < trainers + receivers:
        pytest.skip(f"needs {trainers + receivers} GPUs, have {torch.cuda.device_count()}")
    reports = _run(trainers, source, backend="nccl", receivers=receivers)
    check_bit_identical(reports, trainers, source)


def test_nccl_sync_gathered_from_two_trainers_is_bit_identical_on_two_gpus():
    # The two-GPU form of (2, "gather") above: only trainer 0 sends, so the receiver shares no
    # NCCL group with trainer 1 and may sit on its GPU (NCCL wants one GPU per rank of a group).
    # "shards" has no such form: the receiver is in every trainer's group.
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, have {torch.cuda.device_count()}")
    if torch.cuda.device_count() > 2:
        pytest.skip("three GPUs or more run the three-GPU form above")
    reports = _run(2, "gather", backend="nccl", receivers=1, first_receiver_gpu=1)
    check_bit_identical(reports, 2, "gather")


def test_nccl_sync_on_streams_of_the_highest_priority_is_bit_identical():
    # transport.nccl_high_priority: every rank's group runs on a high-priority stream, and the
    # pipelined sync (packing beside the wire on one side, loading beside it on the other) still
    # lands every element
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    reports = _run(1, "gather", backend="nccl", receivers=1, high_priority=True)
    check_bit_identical(reports, 1, "gather")
    assert [r["high_priority"] for r in reports] == [[True], [True]]
    plain = _run(1, "gather", backend="nccl", receivers=1)
    assert [r["high_priority"] for r in plain] == [[False], [False]]


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (2, "shards")])
def test_nccl_snapshot_sent_beside_the_next_step_is_bit_identical(trainers, source):
    receivers = 2 if torch.cuda.device_count() >= trainers + 2 else 1
    if torch.cuda.device_count() < trainers + receivers:
        pytest.skip(f"needs {trainers + receivers} GPUs, have {torch.cuda.device_count()}")
    reports = _run(trainers, source, backend="nccl", receivers=receivers, overlap=True)
    check_bit_identical(reports, trainers, source)
    assert [r["staged_on"] for r in reports if r["role"] == "trainer"] == [[]] * trainers  # sent as views


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (2, "shards")])
def test_nccl_delta_sync_is_bit_identical_in_a_share_of_the_bytes(trainers, source):
    # transport.delta=on over NCCL: the comparison, the payloads and their application on the GPUs
    if torch.cuda.device_count() < trainers + 1:
        pytest.skip(f"needs {trainers + 1} GPUs, have {torch.cuda.device_count()}")
    check_delta(_run(trainers, source, backend="nccl", receivers=1, delta=True))


def test_nccl_checksum_mismatch_rejects_the_version():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    reports = _run(1, "gather", corrupt=True, backend="nccl", receivers=1)
    for r in (x for x in reports if x["role"] == "receiver"):
        assert r["rejected"] and "checksum mismatch" in r["rejected"]
        assert r["weights"] == r["before"]


@pytest.mark.parametrize("overlap", [False, True])
def test_gloo_sync_between_processes_sharing_one_gpu_packs_on_the_gpu_and_is_bit_identical(overlap):
    # cluster=one_gpu: trainer and receivers on one GPU, the weights over gloo. The sender packs
    # (and casts) each bucket on the GPU and hands gloo the GPU buffer, which it stages through
    # pinned host memory, instead of copying tensor by tensor into pageable host buffers. From a
    # snapshot (overlap) the buckets are views of the snapshot, laid out as them on the GPU: no
    # staging buffer at all (tests/integration/test_sync_modes.py checks the same on CPU).
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    reports = _run(1, "gather", backend="gloo-cuda", receivers=2, overlap=overlap)
    check_bit_identical(reports, 1, "gather")
    trainer = next(r for r in reports if r["role"] == "trainer")
    assert trainer["staged_on"] == ([] if overlap else ["cuda:0"])
