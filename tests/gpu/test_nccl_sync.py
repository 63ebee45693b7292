"""The model-level sync of tests/integration/test_sync_modes.py over NCCL, one GPU
per process (trainers first, then 2 receivers). Run on the GPU machines."""

import pytest
import torch

from tests.integration.test_sync_modes import _run, check_bit_identical

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (2, "gather"), (2, "shards")])
def test_nccl_pipelined_sync_is_bit_identical(trainers, source):
    receivers = 2 if torch.cuda.device_count() >= trainers + 2 else 1
    if torch.cuda.device_count() < trainers + receivers:
        pytest.skip(f"needs {trainers + receivers} GPUs, have {torch.cuda.device_count()}")
    reports = _run(trainers, source, backend="nccl", receivers=receivers)
    check_bit_identical(reports, trainers, source)


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (2, "shards")])
def test_nccl_snapshot_sent_beside_the_next_step_is_bit_identical(trainers, source):
    receivers = 2 if torch.cuda.device_count() >= trainers + 2 else 1
    if torch.cuda.device_count() < trainers + receivers:
        pytest.skip(f"needs {trainers + receivers} GPUs, have {torch.cuda.device_count()}")
    reports = _run(trainers, source, backend="nccl", receivers=receivers, overlap=True)
    check_bit_identical(reports, trainers, source)


def test_nccl_checksum_mismatch_rejects_the_version():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    reports = _run(1, "gather", corrupt=True, backend="nccl", receivers=1)
    for r in (x for x in reports if x["role"] == "receiver"):
        assert r["rejected"] and "checksum mismatch" in r["rejected"]
        assert r["weights"] == r["before"]
