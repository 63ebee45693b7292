"""disagg's weight-transfer backend for vLLM, registered as ``"disagg"``.

vLLM creates this engine inside the process that holds the model (worker or
EngineCore) when started with ``weight_transfer_config={"backend": "disagg"}``;
the ``vllm.general_plugins`` entry point in pyproject.toml registers it in
every vLLM process (``vllm_plugin.register``). Receiving goes through ``disagg.transport.receiver`` - the
same unpacking as every other receiver - and loads through vLLM's layerwise
reload so vLLM itself fuses qkv / gate_up and repacks CPU weights.

This module is the only place that touches vLLM's model internals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from disagg.errors import ChecksumError
from disagg.transport.group import create_group
from disagg.transport.manifest import Manifest
from disagg.transport.sync import receive_model

log = logging.getLogger("disagg.rollout.transfer")


@dataclass
class DisaggInitInfo(WeightTransferInitInfo):
    groups: list  # [host, port, group name] per source group (one per sending trainer rank)
    world_size: int
    rank_offset: int
    backend: str
    timeout_s: float
    source: str = "gather"
    num_buffers: int = 2
    verify: bool = False


@dataclass
class DisaggUpdateInfo(WeightTransferUpdateInfo):
    manifest: dict


class DisaggWeightTransferEngine(WeightTransferEngine[DisaggInitInfo, DisaggUpdateInfo]):
    """Receives disagg's bucketed broadcasts and loads them into the vLLM model.

    The layerwise reload starts lazily, right before the first tensors are loaded:
    with ``verify`` that is after every bucket's checksum matched, so a rejected
    version never touches the model and the engine keeps serving the previous one.
    """

    init_info_cls = DisaggInitInfo
    update_info_cls = DisaggUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: list = []
        self.info: DisaggInitInfo | None = None
        self.last_stats: dict[str, Any] = {}
        self._reloading = False

    def init_transfer_engine(self, init_info: DisaggInitInfo) -> None:
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.shutdown()
        self.info = init_info
        self.groups = [
            create_group(host=host, port=int(port), rank=rank, world_size=init_info.world_size,
                         backend=init_info.backend, timeout_s=init_info.timeout_s, group_name=name, device=self.device)
            for host, port, name in init_info.groups
        ]
        log.info("[rollout] joined %d transport group(s) as rank %d/%d", len(self.groups), rank, init_info.world_size)

    def start_weight_update(self) -> None:
        self._reloading = False

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not self._reloading:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._reloading = True
        # vLLM's layerwise reload holds the tensors it is given until their layer is
        # complete, which may be after the receive buffer they view was reused for a
        # later bucket: hand it copies of views.
        self.model.load_weights([(n, t.clone() if t._base is not None else t) for n, t in tensors])

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on
        # a machine with no accelerator; our receive synchronises the stream itself.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DisaggUpdateInfo) -> None:
        if not self.groups or self.info is None:
            raise RuntimeError("disagg weight transfer: init_weight_transfer_engine was never called")
        manifest = Manifest.from_dict(update_info.manifest)
        self.last_stats = {"policy_version": manifest.policy_version, "rejected": None}
        try:
            stats = receive_model(self.groups, manifest, self._load, device=self.device, source=self.info.source,
                                  num_buffers=self.info.num_buffers, verify=self.info.verify)
        except ChecksumError as e:
            self.last_stats["rejected"] = str(e)
            raise
        except BaseException:
            # A broken broadcast leaves vLLM's layerwise reload half done (some layers on the meta
            # device): finish it, so the model is whole again - part old, part new weights, never
            # served (the engine's gate stays closed) - and the next sync can reload it.
            if self._reloading:
                try:
                    self.finish_weight_update()
                except Exception as e:  # noqa: BLE001 - the receive's own error is the one raised
                    log.error("[rollout] could not finish the interrupted weight reload: %s", e)
            raise
        self.last_stats.update(bytes=stats.bytes, seconds=stats.seconds, num_buckets=stats.num_buckets,
                               num_tensors=stats.num_tensors)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._reloading:
            return
        finalize_layerwise_reload(self.model, self.model_config)
        self._reloading = False
        # A tied lm_head keeps the dummy weights' packed copy unless its quant
        # method re-processes the reloaded embedding (REFERENCE.md, CPU pitfalls).
        for module in self.model.modules():
            if isinstance(module, VocabParallelEmbedding):
                module.quant_method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        for g in self.groups:
            g.destroy()
        self.groups = []

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
