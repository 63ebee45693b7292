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

from disagg.transport.group import create_group
from disagg.transport.manifest import Manifest
from disagg.transport.receiver import receive_weights

log = logging.getLogger("disagg.rollout.transfer")


@dataclass
class DisaggInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int
    rank_offset: int
    backend: str
    timeout_s: float
    group_name: str


@dataclass
class DisaggUpdateInfo(WeightTransferUpdateInfo):
    manifest: dict


class DisaggWeightTransferEngine(WeightTransferEngine[DisaggInitInfo, DisaggUpdateInfo]):
    """Receives disagg's bucketed broadcasts and loads them into the vLLM model."""

    init_info_cls = DisaggInitInfo
    update_info_cls = DisaggUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.last_stats: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: DisaggInitInfo) -> None:
        pc = self.parallel_config
        worker_rank = pc.data_parallel_index * pc.world_size + pc.rank
        rank = init_info.rank_offset + worker_rank
        if self.group is not None:
            self.group.destroy()
        self.group = create_group(
            host=init_info.host,
            port=init_info.port,
            rank=rank,
            world_size=init_info.world_size,
            backend=init_info.backend,
            timeout_s=init_info.timeout_s,
            group_name=init_info.group_name,
            device=self.device,
        )
        log.info("[rollout] joined transport group %s as rank %d/%d", init_info.group_name, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on
        # a machine with no accelerator; our receive is synchronous on CPU and
        # synchronises the stream itself on GPU.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: DisaggUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("disagg weight transfer: init_weight_transfer_engine was never called")
        manifest = Manifest.from_dict(update_info.manifest)
        stats = receive_weights(self.group, manifest, self.model.load_weights, device=self.device)
        self.last_stats = {
            "policy_version": manifest.policy_version,
            "bytes": stats.bytes,
            "seconds": stats.seconds,
            "num_buckets": stats.num_buckets,
            "num_tensors": stats.num_tensors,
        }

    def finish_weight_update(self) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        # A tied lm_head keeps the dummy weights' packed copy unless its quant
        # method re-processes the reloaded embedding (REFERENCE.md, CPU pitfalls).
        for module in self.model.modules():
            if isinstance(module, VocabParallelEmbedding):
                module.quant_method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


class DisaggWorkerExtension:
    """Methods added to vLLM's worker (``worker_extension_cls``) for disagg's own queries."""

    def disagg_transfer_stats(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.last_stats) if engine is not None else {}
