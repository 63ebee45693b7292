"""disagg's methods on SGLang's ``Scheduler``: SGLang's entry into disagg's one engine-neutral receiver
(``disagg.transport.model_receiver.ModelReceiver``).

``plugin.register`` (entry point ``sglang.srt.plugins``, which SGLang loads in every scheduler
process: ``managers/scheduler.py:4895``) copies ``DisaggScheduler``'s methods onto SGLang's
``Scheduler``; the backend reaches them through SGLang's collective RPC, which calls
``getattr(scheduler, method)(**parameters)`` in every scheduler process
(``Scheduler.handle_rpc_request``, ``managers/scheduler.py:4304-4324``). That RPC carries only flat
scalars (``RpcReqInput.parameters``, ``managers/io_struct.py:2102-2105``) and answers only success and
an error message (``RpcReqOutput``; the method's return value is dropped), so one method,
``disagg_call``, takes the call's arguments as JSON and writes each scheduler's answer as JSON to a
file of the call's (the engine actor and its schedulers share a host: SGLang spawns them as its
children). What is SGLang's here: the live model (``self.tp_worker.model_runner.model``), its device
(``model_runner.device``, ``gpu_id``), this scheduler's TP rank (``model_runner.ps.tp_rank``) and
whether the model is quantised (``model_runner.model_config.quantization``). SGLang has no layerwise
reload: the receiver loads directly into the live parameters, as SGLang's own
``update_weights_from_distributed`` does (``model_executor/model_runner_components/weight_updater.py:222-272``:
``model.load_weights``), and refuses ``transport.load=layerwise``.

This module imports no SGLang (the unit tests drive it against a stand-in scheduler): ``plugin``
does, to put it on SGLang's class.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from disagg.transport.model_receiver import DisaggInitInfo, DisaggUpdateInfo, ModelReceiver

CALLS = ("disagg_join", "disagg_sync", "disagg_transfer_stats", "disagg_param_checksums", "disagg_arm_fault",
         "disagg_set_load_mode", "disagg_raw_receive")
"""What ``disagg_call`` runs: the engine actor's names for its model workers' calls (vLLM's worker
extension has the same), and ``disagg_join``."""


def reply_path(reply: str, tp_rank: int) -> str:
    """The file a scheduler of TP rank ``tp_rank`` writes its answer to a call to."""
    return f"{reply}.{tp_rank}.json"


class DisaggScheduler:
    """The methods ``plugin.register`` adds to SGLang's ``Scheduler`` (``self`` is a scheduler)."""

    def disagg_call(self, method: str, args: str, reply: str) -> None:
        """Run ``method`` (one of ``CALLS``) with the JSON list ``args``; its answer, as JSON, into
        ``reply_path(reply, this scheduler's TP rank)`` (written whole before the RPC returns)."""
        if method not in CALLS:
            raise ValueError(f"disagg: no scheduler call {method!r} (one of {', '.join(CALLS)})")
        answer = getattr(self, method)(*json.loads(args))
        path = reply_path(reply, self._disagg_rank())
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            json.dump(answer, f)
        os.replace(f"{path}.tmp", path)

    def disagg_join(self, info: dict[str, Any]) -> None:
        """Join the transport groups (``DisaggInitInfo``) as this engine's worker of this TP rank."""
        self._disagg_receiver().join(DisaggInitInfo(**info), self._disagg_rank())

    def disagg_sync(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """One weight update (``DisaggUpdateInfo``) into the live model; the receive's figures."""
        receiver = self._disagg_receiver()
        if receiver.device.type == "cuda":
            # The scheduler takes this call between its loop's turns, but with SGLang's overlap
            # schedule the forward it launched last may still run on the GPU, reading the weights
            # about to be overwritten (a pause in place leaves it so: scheduler.py:4469-4478).
            torch.cuda.synchronize(receiver.device)
        return receiver.sync(DisaggUpdateInfo(**update_info))

    def disagg_transfer_stats(self) -> dict[str, Any]:
        """The last update's figures (``ModelReceiver.last_stats``; empty before any)."""
        receiver = getattr(self, "_disagg_model_receiver", None)
        return dict(receiver.last_stats) if receiver is not None else {}

    def disagg_param_checksums(self) -> dict[str, list[int]]:
        """Each parameter's bit checksum: the test that a sync left every parameter equal to the
        trainer's, bit for bit."""
        return self._disagg_receiver().param_checksums()

    def disagg_arm_fault(self, point: str, action: str, after: int) -> None:
        """Fault-injection tests: make this scheduler fail for real at ``point`` (``disagg.faults``)."""
        from disagg import faults

        faults.arm(point, action, after)

    def disagg_set_load_mode(self, mode: str) -> str:
        """Load the next updates with ``mode`` (``transport.load``); the mode resolved."""
        return self._disagg_receiver().set_load_mode(mode)

    def disagg_raw_receive(self, nbytes: int, repeats: int) -> list[float]:
        """Raw broadcasts of ``nbytes`` from the trainer on the first transport group; each one's seconds."""
        return self._disagg_receiver().raw_receive(nbytes, repeats)

    def _disagg_receiver(self) -> ModelReceiver:
        """This scheduler's receiver, made at its first use over its model runner's live model."""
        receiver = getattr(self, "_disagg_model_receiver", None)
        if receiver is None:
            runner = self.tp_worker.model_runner
            device = torch.device(runner.device, runner.gpu_id) if runner.device == "cuda" else torch.device(runner.device)
            receiver = ModelReceiver(runner.model, device, engine="SGLang",
                                     quantized=runner.model_config.quantization is not None)
            self._disagg_model_receiver = receiver
        return receiver

    def _disagg_rank(self) -> int:
        """This scheduler's TP rank: its place among the engine's workers."""
        return int(self.tp_worker.model_runner.ps.tp_rank)
