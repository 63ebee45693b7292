"""``disagg bench vllm-sync --peer checkpoint-engine`` on CPU: the option check, the report's register
seconds, where the ParameterServer's ranks go, the import error, and rank 0's sink against the zmq
exchange checkpoint-engine 0.4.2's ``ParameterServer._update_per_bucket`` runs (no GPU, no Ray)."""

from __future__ import annotations

import sys
import threading
import types
import uuid

import pytest

from disagg.peers import ckpt_engine as ckpt_engine_peer
from disagg.bench.vllm_sync import render, resolve_options, summarise
from disagg.errors import TransportError


def test_checkpoint_engine_is_a_peer_on_cuda_and_refused_on_cpu_with_its_reason():
    assert resolve_options({"device": "cuda", "peer": "checkpoint-engine"}, gpus=2).peer == "checkpoint-engine"
    with pytest.raises(ValueError, match=r"--peer checkpoint-engine needs --device cuda \(checkpoint-engine 0.4.2"):
        resolve_options({"device": "cpu", "peer": "checkpoint-engine"}, gpus=0)
    with pytest.raises(ValueError, match=r"--peer vllm-nccl needs --device cuda \(vLLM's own NCCL engine\)"):
        resolve_options({"device": "cpu", "peer": "vllm-nccl"}, gpus=0)
    with pytest.raises(ValueError, match=r"unknown peer 'mooncake' \(vllm-nccl, checkpoint-engine\)"):
        resolve_options({"device": "cuda", "peer": "mooncake"}, gpus=2)


def _syncs():
    return {"direct": [{"seconds": s, "send_s": 0.0, "phases": {}} for s in (0.02, 0.01, 0.03)]}


def test_summary_reports_the_register_apart_and_the_speedup_with_and_without_it():
    out = summarise([0.008, 0.009, 0.01], _syncs(), peer_s=[0.08, 0.07, 0.09], peer_register_s=[1.0, 0.5, 0.6])
    p = out["peer"]
    assert p["seconds"] == 0.08 and p["register_s"] == 0.6
    assert p["disagg_speedup"] == pytest.approx(0.08 / 0.02)
    # the median of each iteration's register + update (1.08, 0.57, 0.69), not a sum of medians
    assert p["disagg_speedup_with_register"] == pytest.approx(0.69 / 0.02)
    plain = summarise([0.008], _syncs(), peer_s=[0.08])["peer"]
    assert "register_s" not in plain and "disagg_speedup_with_register" not in plain
    with pytest.raises(ValueError):  # one register per update
        summarise([0.008], _syncs(), peer_s=[0.08, 0.07], peer_register_s=[1.0])


def test_render_shows_the_peers_route_and_its_register(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    report = summarise([0.008, 0.009, 0.01], _syncs(), peer_s=[0.08, 0.07, 0.09], peer_register_s=[1.0, 0.5, 0.6])
    report.update(bytes=3_090_000_000, machine="2 x H100", backend="nccl", engine_workers=1, syncs=_syncs(),
                  options={"overrides": ["shape=qwen2.5-1.5b"], "peer": "checkpoint-engine"}, trainer="1 worker")
    render(report)
    text = capsys.readouterr().out
    assert "checkpoint-engine (checkpoint-engine 0.4.2: NCCL broadcast, CUDA IPC): same bytes, same engine" in text
    assert "register (cast, copy into its pinned host memory)" in text and "0.6000" in text
    assert "4.00x" in text and "34.50x" in text  # against the update alone, and against register + update


@pytest.mark.parametrize("engines, tp, trainers, expected, error", [
    (1, 1, 1, (2, [1]), None),
    (3, 1, 1, (4, [1, 2, 3]), None),
    (1, 2, 1, None, "rollout.tensor_parallel_size=2"),
    (1, 1, 2, None, "trainer.num_workers=2"),
    (0, 1, 1, None, "no engine"),
])
def test_parameter_server_ranks_put_the_trainer_at_zero_and_one_rank_per_engine(engines, tp, trainers, expected, error):
    if error is None:
        assert ckpt_engine_peer.ps_ranks(engines, tp, trainers) == expected
    else:
        with pytest.raises(ValueError, match=error):
            ckpt_engine_peer.ps_ranks(engines, tp, trainers)


def test_a_missing_checkpoint_engine_names_the_wheel_and_a_wrong_version_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "checkpoint_engine", None)  # import fails, installed or not
    with pytest.raises(ImportError, match=r"checkpoint_engine-0\.4\.2-py3-none-any\.whl.*PYTHONPATH"):
        ckpt_engine_peer.checkpoint_engine()
    monkeypatch.setitem(sys.modules, "checkpoint_engine", types.SimpleNamespace(__version__="0.5.0"))
    with pytest.raises(ImportError, match="found 0.5.0"):
        ckpt_engine_peer.checkpoint_engine()


class _Storage:
    """Stands in for the storage class in a CUDA IPC handle: records the reference released."""

    released: list = []

    @classmethod
    def _release_ipc_counter(cls, handle, offset, device=None):
        cls.released.append((handle, offset, device))


def _handle():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = [None] * 15
    args[4], args[6], args[11], args[12] = _Storage, 0, b"/torch_ref_counter", 3
    return rebuild_cuda_tensor, tuple(args)


def _run(target, *args):
    errors: list[BaseException] = []

    def body():
        try:
            target(*args)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    return t, errors


def _parameter_server_with_sink():
    """The ParameterServer's side of rank 0's exchange (a bound REQ socket, as ``ps._bind_zmq_socket``
    makes it) and the sink answering it on a thread: (context, socket, thread, the thread's errors)."""
    zmq = pytest.importorskip("zmq")
    path = f"ipc://@disagg-test-sink-{uuid.uuid4().hex}.sock"
    ctx = ckpt_engine_peer._bound(zmq.Context(), 5.0)
    req = ctx.socket(zmq.REQ)
    req.bind(path)
    return (ctx, req, *_run(ckpt_engine_peer.sink, path, 5.0))


def test_rank_zeros_sink_answers_the_parameter_servers_exchange_and_releases_the_buffer_once():
    import torch

    _Storage.released.clear()
    ctx, req, t, errors = _parameter_server_with_sink()
    try:
        # ps._update_per_bucket, rank 0, two buckets: the handle, each bucket's tensors, None, None
        req.send_pyobj(_handle())
        for i in range(2):
            assert req.recv() == b""
            req.send_pyobj([{"name": f"w{i}", "dtype": torch.bfloat16, "shape": torch.Size([4]), "offset": 0}])
        assert req.recv() == b""
        assert _Storage.released == []
        req.send_pyobj(None)  # release: the ParameterServer frees the buffer once this is answered
        assert req.recv() == b""
        assert _Storage.released == [(b"/torch_ref_counter", 3, 0)]
        req.send_pyobj(None)  # post hook
        assert req.recv() == b""
        t.join(5)
    finally:
        ctx.destroy(linger=0)
    assert not t.is_alive() and errors == []
    assert len(_Storage.released) == 1


def test_the_sink_raises_what_the_parameter_server_gives_up_with_and_times_out_alone():
    ctx, req, t, errors = _parameter_server_with_sink()
    try:
        req.send_pyobj(_handle())
        assert req.recv() == b""
        req.send_pyobj(RuntimeError("Some workers failed to update weights"))
        t.join(5)
    finally:
        ctx.destroy(linger=0)
    assert not t.is_alive() and [str(e) for e in errors] == ["Some workers failed to update weights"]
    with pytest.raises(TransportError, match="waits end after 0s"):  # no ParameterServer: bounded, not a hang
        ckpt_engine_peer.sink(f"ipc://@disagg-test-sink-{uuid.uuid4().hex}.sock", 0.2)
