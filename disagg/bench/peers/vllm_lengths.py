"""A vLLM logits processor for ``disagg bench peers``: the same response lengths, and the same record
of when the engine works, in every framework's vLLM.

The peers comparison runs one GRPO job in disagg, verl and TRL. None of them lets a data row set its
own ``max_tokens``/``min_tokens``, yet the job's heavy tail (most responses short, a tenth long) must
be the same tokens in each. All three run vLLM, so the lengths are enforced inside vLLM: this
processor is a ``vllm.logits_processors`` plugin, which vLLM loads in every engine process, whoever
built the engine. The bench puts the plugin's dist-info on the frameworks' ``PYTHONPATH`` only
(``disagg.bench.peers.bench_site``): an engine outside the bench never loads it.

With ``DISAGG_PEERS_LENGTHS`` set each request is held to its prompt's length (``lengths.py``);
unset, lengths are left alone. With ``DISAGG_PEERS_TRACE`` set (a folder) every sampling step is
recorded (``lengths.StepTrace``). It must never change sampling unless the bench asked for it.
"""

from __future__ import annotations

import os

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from disagg.bench.peers.lengths import LENGTHS_ENV, TRACE_ENV, Lengths, StepTrace, force_lengths, target_length


class PeersLengths(LogitsProcessor):
    """Holds each response to its prompt's ``target_length`` and records sampling steps (see above)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        spec = os.environ.get(LENGTHS_ENV)
        self.lengths = Lengths.parse(spec) if spec else None
        self.reqs: dict[int, tuple] = {}  # batch row -> (target, its output ids so far, its stopping ids)
        folder = os.environ.get(TRACE_ENV)
        self.trace = StepTrace(folder) if folder else None

    def is_argmax_invariant(self) -> bool:
        return False  # banning and forcing end-of-sequence changes which token is likeliest

    def _new(self, params, prompt_ids, output_ids):
        if self.lengths is None or prompt_ids is None:
            return None
        # every id that would stop the request (the model's end-of-sequence ids, the request's stop ids)
        return target_length(prompt_ids, self.lengths), output_ids, tuple(params.all_stop_token_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.reqs, batch_update, self._new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.trace is not None:
            self.trace.record(logits.shape[0])
        if not self.reqs:
            return logits
        return force_lengths(logits, self.reqs, self.lengths.eos)
