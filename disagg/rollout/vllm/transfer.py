"""disagg's weight-transfer backend for vLLM, registered as ``"disagg"``: vLLM's entry into disagg's
one engine-neutral receiver (``disagg.transport.model_receiver.ModelReceiver``).

vLLM creates this engine inside the process that holds the model (worker or
EngineCore) when started with ``weight_transfer_config={"backend": "disagg"}``;
the ``vllm.general_plugins`` entry point in pyproject.toml registers it in
every vLLM process (``plugin.register``). What is vLLM's is here: its base class and the
typed infos its ``parse_init_info`` / ``parse_update_info`` build, this worker's place among the
engine's workers (``parallel_config``), whether the model is quantised, that vLLM's CPU linear
layers repack their weights, and vLLM's layerwise reload (``api.begin_layerwise_reload`` /
``end_layerwise_reload``). Joining the groups, receiving, the two load modes (``transport.load``),
copy plans, delta images and the figures of each update are the receiver's.

A sync is one call into the worker (``DisaggWorkerExtension.disagg_sync``: vLLM's start, update and
finish, returning the receive's figures), and the manifest crosses into the worker only when its
layout changes (the receiver keeps it by layout digest).

This module is the only place that touches vLLM's model internals.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from disagg.logs import traced
from disagg.rollout.vllm import api as vllm_api
from disagg.transport.model_receiver import DisaggInitInfo, DisaggUpdateInfo, LayerwiseReload, ModelReceiver


class VllmInitInfo(DisaggInitInfo, WeightTransferInitInfo):
    """``DisaggInitInfo`` as vLLM's ``parse_init_info`` builds it."""


class VllmUpdateInfo(DisaggUpdateInfo, WeightTransferUpdateInfo):
    """``DisaggUpdateInfo`` as vLLM's ``parse_update_info`` builds it."""


class DisaggWeightTransferEngine(WeightTransferEngine[VllmInitInfo, VllmUpdateInfo]):
    """vLLM's weight-transfer calls handed to a ``ModelReceiver`` of this worker's model."""

    init_info_cls = VllmInitInfo
    update_info_cls = VllmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = ModelReceiver(model, device, engine="vLLM",
                                      quantized=getattr(vllm_config, "quant_config", None) is not None,
                                      repacks=device.type != "cuda",
                                      reload=LayerwiseReload(self._begin_reload, self._end_reload))

    @property
    def last_stats(self) -> dict[str, Any]:
        """The last update's figures (``ModelReceiver.last_stats``)."""
        return self.receiver.last_stats

    def init_transfer_engine(self, init_info: VllmInitInfo) -> None:
        pc = self.parallel_config
        self.receiver.join(init_info, pc.data_parallel_index * pc.world_size + pc.rank)

    def set_load_mode(self, requested: str) -> str:
        """Load the next updates as ``requested`` (``transport.load``) resolves for this worker; the mode."""
        return self.receiver.set_load_mode(requested)

    def start_weight_update(self) -> None:
        self.receiver.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on
        # a machine with no accelerator; our receive synchronises the stream itself.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: VllmUpdateInfo) -> None:
        self.receiver.receive(update_info)

    def finish_weight_update(self) -> None:
        self.receiver.finish()

    def shutdown(self) -> None:
        self.receiver.shutdown()

    def _begin_reload(self) -> None:
        vllm_api.begin_layerwise_reload(self.model)

    def _end_reload(self) -> None:
        vllm_api.end_layerwise_reload(self.model, self.model_config)

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM's trainer-side hook (abstract in vLLM 0.26). disagg's trainers send through
        ``disagg.transport`` (TrainerWorker.push_weights), never through this class."""
        raise NotImplementedError("disagg trainers send weights with disagg.transport, not the vLLM backend class")


class DisaggWorkerExtension:
    """Methods added to vLLM's worker (``worker_extension_cls``) for disagg's own queries."""

    def disagg_arm_fault(self, point: str, action: str, after: int) -> None:
        from disagg import faults

        faults.arm(point, action, after)

    def disagg_transfer_stats(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.last_stats) if engine is not None else {}

    def disagg_sync(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """One weight update in one call from the engine actor: vLLM's start, update and finish (the
        worker's own methods, as ``AsyncLLM`` calls them one round trip each); the receive's figures.
        After ``disagg_trace_next_sync`` it runs under ``torch.profiler`` (``trace``: the file)."""
        path, self._disagg_trace = getattr(self, "_disagg_trace", None), None
        device = getattr(self.weight_transfer_engine, "device", None)
        return traced(path, getattr(device, "type", "") == "cuda", lambda: self._disagg_sync(update_info))

    def _disagg_sync(self, update_info: dict[str, Any]) -> dict[str, Any]:
        entered = time.time()
        self.start_weight_update()
        self.update_weights(update_info)
        self.finish_weight_update()
        return dict(self.weight_transfer_engine.last_stats, worker_in_unix_s=entered, worker_out_unix_s=time.time())

    def disagg_trace_next_sync(self, path: str) -> str:
        """Benchmarks: the next ``disagg_sync`` of this worker (its receive loop, loads and vLLM's
        start / finish) runs under ``torch.profiler`` and is written as a Chrome trace to ``path``
        with this worker's rank before its suffix; returns that file's path."""
        from pathlib import Path

        p = Path(path)
        self._disagg_trace = str(p.with_name(f"{p.stem}.w{getattr(self, 'rank', 0)}{p.suffix}"))
        return self._disagg_trace

    def disagg_set_load_mode(self, mode: str) -> str:
        """``disagg bench vllm-sync``: load the next updates with ``mode`` (``transport.load``); the mode resolved."""
        return self.weight_transfer_engine.set_load_mode(mode)

    def disagg_param_checksums(self) -> dict[str, list[int]]:
        """Each vLLM parameter's bit checksum (``ModelReceiver.param_checksums``): the test that a sync
        left every parameter equal to the trainer's, bit for bit, without moving the weights anywhere."""
        return self._disagg_engine().receiver.param_checksums()

    def disagg_peer_init(self, init_info: dict[str, Any]) -> None:
        """``disagg bench vllm-sync --peer vllm-nccl``: join a group with the trainer through vLLM's own
        NCCL weight-transfer engine, kept beside disagg's (``disagg_peer_use`` swaps them)."""
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        ours = self.weight_transfer_engine
        peer = NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"), ours.vllm_config, ours.device, ours.model)
        peer.init_transfer_engine(peer.parse_init_info(init_info))
        self._disagg_engines = {"disagg": ours, "vllm-nccl": peer}

    def disagg_peer_use(self, name: str) -> None:
        """The weight-transfer engine vLLM's start / update / finish calls go to: "disagg" or "vllm-nccl"."""
        self.weight_transfer_engine = self._disagg_engines[name]

    def disagg_ckpt_receive(self, zmq_handles: dict[str, str], timeout_s: float) -> dict[str, float]:
        """``disagg bench vllm-sync --peer checkpoint-engine``: one update from the ParameterServer rank on this
        GPU, loaded as checkpoint-engine's own ``VllmColocateWorkerExtension`` loads it: vLLM's ``load_weights``
        per bucket (into the live parameters), then ``process_weights_after_loading``. Its seconds."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        from disagg.peers.ckpt_engine import worker_receive

        model = self.model_runner.model
        return worker_receive(zmq_handles, self.device.index, model.load_weights,
                              lambda: process_weights_after_loading(model, self.model_config, self.device), timeout_s)

    def disagg_raw_receive(self, nbytes: int, repeats: int) -> list[float]:
        """``disagg bench vllm-sync``: take part in ``repeats`` raw broadcasts of ``nbytes`` from the trainer
        on this worker's first transport group (the baseline of a sync's rate); each one's seconds."""
        return self._disagg_engine().receiver.raw_receive(nbytes, repeats)

    def _disagg_engine(self) -> DisaggWeightTransferEngine:
        """disagg's engine, also while the peer's is the one vLLM's calls go to (``disagg_peer_use``)."""
        engine = getattr(self, "_disagg_engines", {}).get("disagg", getattr(self, "weight_transfer_engine", None))
        if engine is None:
            raise RuntimeError("disagg: the worker has no weight-transfer engine (weight_transfer_config unset)")
        return engine


def peer_trainer_init(host: str, port: int, world_size: int):
    """``disagg bench vllm-sync --peer vllm-nccl``, the trainer's side: vLLM's own NCCL group (rank 0)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    return NCCLWeightTransferEngine.trainer_init({"master_address": host, "master_port": port, "world_size": world_size})


def peer_trainer_send(group, named_tensors, dtype: torch.dtype) -> None:
    """Send ``named_tensors`` cast to ``dtype`` as vLLM's own NCCL engine does (packed, its default buffers)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

    NCCLWeightTransferEngine.trainer_send_weights(
        iter(named_tensors), NCCLTrainerSendWeightsArgs(group=group, packed=True,
                                                        post_iter_func=lambda item: item[1].to(dtype)))
    torch.cuda.synchronize()  # vLLM's producer returns with its last broadcast in flight on a stream of its own
