"""SGLang behind the engine seam (``disagg.rollout.backend.EngineBackend``): one in-process
``sglang.Engine`` (0.5.17), driven from the engine actor's event loop.

The Engine's own methods are synchronous wrappers that run ``loop.run_until_complete`` on the actor's
running loop, so this backend calls its tokenizer manager's coroutines instead
(``managers/tokenizer_manager.py``: ``generate_request`` L744, ``abort_request`` L1930,
``pause_generation`` L1974, ``continue_generation`` L1989; ``flush_cache`` in
``tokenizer_control_mixin.py:296``), and makes the Engine's collective RPC itself
(``entrypoints/engine.py:1558-1563`` sends ``RpcReqInput`` on ``Engine.send_to_rpc`` and waits for
the ``RpcReqOutput``) from a worker thread, so the loop keeps serving while a sync runs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from disagg.config import RolloutConfig
from disagg.errors import EngineDeadError, RolloutError, TransportError
from disagg.rollout.sglang.hook import reply_path
from disagg.rollout.types import EngineOutput, SampleOutput

TRANSPORT_CALLS = ("disagg_join", "disagg_sync", "disagg_raw_receive")
"""Scheduler calls whose failure is the transport's (``TransportError``)."""


def actor_env(device: str, cfg: RolloutConfig, bundle_indices: list[int]) -> dict[str, str]:
    """An SGLang engine actor's environment (``rollout.engines``): nothing of disagg's. SGLang takes its
    log level as an argument (``engine_args``), its GPU from the CUDA_VISIBLE_DEVICES Ray gives the
    actor, and sets its NCCL variables only where unset (``entrypoints/engine.py:1582-1591``), so the
    GPU runner's exported ones stay."""
    return {}


def engine_args(cfg: RolloutConfig, model_path: str, seed: int) -> dict[str, Any]:
    """``sglang.Engine``'s arguments (``ServerArgs`` fields, ``srt/server_args.py``) for ``cfg``: token
    ids in and out (``skip_tokenizer_init``), Triton attention and PyTorch sampling (the carry leaves
    out the FA3 kernels SGLang defaults to on Hopper, ``server_args.py:5682-5688``), and disagg's
    options as SGLang names them (the package docstring lists each)."""
    args = dict(model_path=model_path, load_format=cfg.load_format, dtype=cfg.dtype,
                context_length=cfg.max_model_len, max_running_requests=cfg.max_num_seqs,
                mem_fraction_static=cfg.gpu_memory_utilization, tp_size=cfg.tensor_parallel_size,
                random_seed=seed, skip_tokenizer_init=True, attention_backend="triton",
                sampling_backend="pytorch", disable_cuda_graph=cfg.enforce_eager,
                log_level=cfg.vllm_log_level.lower())
    if cfg.max_cudagraph_capture_size is not None:
        args["cuda_graph_max_bs_decode"] = cfg.max_cudagraph_capture_size
    if cfg.compile:  # null and false: SGLang's default, no torch.compile
        args["enable_torch_compile"] = True
    return args


def sampling_params(*, n: int, max_tokens: int, temperature: float, top_p: float, seed: int | None,
                    ignore_eos: bool) -> dict[str, Any]:
    """SGLang's sampling parameters (``sampling/sampling_params.py:45-81``; temperature 0 is greedy).
    ``seed`` is not passed: SGLang reads a request's ``sampling_seed`` only under its deterministic
    inference (``sampling/sampling_batch_info.py:118-133``), which disagg does not turn on."""
    return {"n": n, "max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "ignore_eos": ignore_eos}


def engine_output(out: dict | list[dict] | None) -> EngineOutput:
    """SGLang's final output of one request (a list for n > 1; None: aborted before its scheduler had
    it) in the engine actor's terms: each sample's ``output_ids``, the log-prob of each from
    ``meta_info["output_token_logprobs"]`` ((log-prob, token id, text) triples, ``return_logprob``:
    ``tokenizer_manager.py:2481-2510, 2699-2709``), its finish reason's type ('stop', 'length',
    'abort': ``managers/schedule_batch.py:199-265``) and the prompt tokens its radix cache gave
    (``meta_info["cached_tokens"]``). SGLang labels no token with a weight version."""
    if out is None:
        return EngineOutput([SampleOutput(0, [], [], "abort", None)])
    outs = out if isinstance(out, list) else [out]
    return EngineOutput([_sample(i, o) for i, o in enumerate(outs)],
                        int(outs[0]["meta_info"].get("cached_tokens", 0)))


def _sample(index: int, out: dict) -> SampleOutput:
    meta = out["meta_info"]
    ids = [int(t) for t in out["output_ids"]]
    triples = meta.get("output_token_logprobs") or []
    if [int(t) for _, t, _ in triples] != ids:
        raise RolloutError(f"SGLang request {meta.get('id')}: log-probs of tokens {[t for _, t, _ in triples]}, "
                           f"output tokens {ids}")
    reason = meta.get("finish_reason") or {}
    return SampleOutput(index, ids, [float(lp) for lp, _, _ in triples], str(reason.get("type", "")), None)


def _retrieved(task: asyncio.Task) -> None:
    """A request's task whose waiter left (cancelled): its outcome is read, never raised unseen."""
    if not task.cancelled():
        task.exception()


async def _first_output(gen) -> Any:
    """The one (final) output of a non-streaming ``generate_request``; the generator is closed at once,
    which releases the model-update reader lock it holds while suspended (``tokenizer_manager.py:787``)."""
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


class SglangBackend:
    """``EngineBackend`` over an in-process ``sglang.Engine`` (its tokenizer manager in the actor's
    process; its scheduler and detokenizer are child processes)."""

    def __init__(self, engine, version: str, cfg: RolloutConfig) -> None:
        self.engine, self.tm = engine, engine.tokenizer_manager
        self.name = f"SGLang {version}"
        self._version = version
        self._tp = cfg.tensor_parallel_size
        self._timeout_s = cfg.weights_wait_timeout_s  # one scheduler call, or aborted requests' end
        self._numbers = itertools.count()
        self._rids: dict[str, str] = {}  # the actor's request id -> SGLang's
        self._tasks: dict[str, asyncio.Task] = {}  # SGLang's request id -> the task awaiting its output
        self._paused = False
        self._served: int | None = None
        self._rpc_lock = asyncio.Lock()
        self._replies = Path(tempfile.mkdtemp(prefix="disagg-sglang-"))

    @classmethod
    def start(cls, cfg: RolloutConfig, model_path: str, seed: int) -> "SglangBackend":
        """SGLang on ``cfg.load_format`` weights (dummy: every weight comes by a sync)."""
        import sglang
        from sglang.srt.entrypoints.engine import Engine

        return cls(Engine(**engine_args(cfg, model_path, seed)), sglang.__version__, cfg)

    def start_report(self) -> dict[str, Any]:
        return {"sglang_version": self._version}

    async def token_version_sources(self) -> list[str]:
        return []  # no labels, no counts: rollout.in_flight_at_sync resolves to resubmit

    def sampling(self, **kw) -> Any:
        return sampling_params(**kw)

    async def submit(self, request_id: str, prompt_ids: list[int], params: Any, cache_salt: str) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        # SGLang's scheduler aborts every request whose id *starts with* the one named
        # (managers/scheduler.py:4335, 4457): a number of this backend's and a colon go first, so no
        # request's id is another's prefix. The salt keys its radix cache (io_struct.py:286-287).
        rid = f"{next(self._numbers)}:{request_id}"
        obj = GenerateReqInput(input_ids=list(prompt_ids), sampling_params=dict(params), return_logprob=True,
                               rid=rid, extra_key=cache_salt)
        task = asyncio.ensure_future(_first_output(self.tm.generate_request(obj, None)))
        self._rids[request_id], self._tasks[rid] = rid, task
        # abort reaches the request once the tokenizer manager holds its state, which its generator
        # makes before its first wait (tokenizer_manager.py:775, _init_req_state)
        while rid not in self.tm.rid_to_state and not task.done():
            await asyncio.sleep(0)
        return request_id, rid, task

    async def final_output(self, handle: Any) -> EngineOutput:
        from sglang.srt.managers.tokenizer_manager import RequestAbortedError

        request_id, rid, task = handle
        try:
            out = await asyncio.shield(task)
        except asyncio.CancelledError:  # the actor's wait was cancelled: the request leaves the engine too
            task.add_done_callback(_retrieved)
            self.tm.abort_request(rid)
            raise
        except RequestAbortedError:  # aborted before it reached the scheduler: nothing sampled
            out = None
        finally:
            self._rids.pop(request_id, None)
            self._tasks.pop(rid, None)
        return engine_output(out)

    async def abort(self, request_ids: list[str]) -> None:
        rids = [self._rids[r] for r in request_ids if r in self._rids]
        for rid in rids:
            self.tm.abort_request(rid)
        tasks = [self._tasks[rid] for rid in rids if rid in self._tasks]
        if tasks and not self._paused:
            # A running request SGLang aborts ends at its next decode step, with that step's token
            # (scheduler.py:4454-4460; batch_result_processor.py:857-864, schedule_batch.py:1572): wait
            # for that end here, so the token comes from the weights the request was served with and
            # not from the version a sync loads next.
            _, pending = await asyncio.wait(tasks, timeout=self._timeout_s)
            if pending:
                raise EngineDeadError(f"{self.name}: {len(pending)} aborted request(s) did not end within "
                                      f"{self._timeout_s:g} s (rollout.weights_wait_timeout_s)")

    def num_unfinished(self) -> int:
        return len(self.tm.rid_to_state)  # every client's requests the tokenizer manager holds

    def tokens_generated(self) -> int | None:
        """No count of SGLang's own here (its Prometheus metrics are off)."""
        return None

    async def pause_in_place(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        # In place: the scheduler keeps every request with its KV and only stops running batches
        # (scheduler.py:4465-4478); the call returns once sent. A sync's scheduler call comes after
        # it and runs between batches (the hook waits for a forward still on the GPU).
        await self.tm.pause_generation(PauseGenerationReqInput(mode="in_place"))
        self._paused = True

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self.tm.continue_generation(ContinueGenerationReqInput())
        self._paused = False

    async def output_counts(self) -> dict[str, int]:
        raise NotImplementedError("SGLang counts no request's tokens at a pause: rollout.in_flight_at_sync=keep "
                                  "is not available with rollout.engine=sglang")

    def sample_of(self, internal_id: str, live: set[str]) -> tuple[str, int] | None:
        request_id = internal_id.partition(":")[2]
        return (request_id, 0) if request_id in live else None

    async def join_transport(self, info: dict[str, Any]) -> None:
        await self._rpc("disagg_join", info)

    async def load_weights(self, update_info: dict[str, Any], policy_version: int) -> dict[str, Any]:
        stats = (await self._rpc("disagg_sync", update_info))[0]
        if not stats.get("cancelled"):  # an armed receive called off loads nothing
            self._served = policy_version
        return stats

    async def reset_prefix_cache(self) -> bool:
        return bool((await self.tm.flush_cache()).success)

    async def set_served_version(self, policy_version: int) -> None:
        self._served = policy_version

    async def served_version(self) -> str | None:
        return None if self._served is None else str(self._served)  # disagg's label: SGLang keeps none per token

    async def check_health(self) -> None:
        import psutil

        dead = [pid for pid in self.engine.get_all_child_pids() if not _alive(psutil, pid)]
        if dead:
            raise EngineDeadError(f"{self.name}: its processes {dead} are gone")

    async def worker_call(self, method: str, *args: Any) -> list[Any]:
        return await self._rpc(method, *args)

    async def openai_app(self, served_model_name: str, tool_call_parser: str | None) -> Any:
        raise NotImplementedError("SGLang's OpenAI server is not behind disagg's weights gate: set "
                                  "rollout.openai_api=false with rollout.engine=sglang")

    def shutdown(self) -> None:
        self.engine.shutdown()
        shutil.rmtree(self._replies, ignore_errors=True)

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` in every scheduler (``hook.DisaggScheduler.disagg_call``); each one's answer,
        by TP rank, read from the files they wrote (the RPC's reply carries none)."""
        reply = str(self._replies / f"{method}.{next(self._numbers)}")
        params = {"method": method, "args": json.dumps(args), "reply": reply}
        async with self._rpc_lock:  # one call at a time on the engine's RPC socket
            out = await asyncio.to_thread(self._rpc_blocking, params)
        if not out.success:
            hint = (" (is disagg's SGLang plugin loaded in its schedulers? entry point sglang.srt.plugins "
                    "'disagg', from disagg's installed wheel; SGLANG_PLUGINS must name it where set)"
                    if "disagg_call" in out.message else "")
            error = TransportError if method in TRANSPORT_CALLS else RolloutError
            raise error(f"{self.name}: scheduler call {method} failed: {out.message}{hint}")
        answers = []
        for rank in range(self._tp):
            path = Path(reply_path(reply, rank))
            answers.append(json.loads(path.read_text(encoding="utf-8")))
            path.unlink()
        return answers

    def _rpc_blocking(self, params: dict[str, str]):
        """Engine.collective_rpc's exchange (``entrypoints/engine.py:1558-1563``), bounded in time and
        answering the ``RpcReqOutput`` where Engine's asserts its success."""
        from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

        sock = self.engine.send_to_rpc
        sock_send(sock, RpcReqInput(method="disagg_call", parameters=params))
        if not sock.poll(int(self._timeout_s * 1000)):
            raise EngineDeadError(f"{self.name}: no answer to scheduler call {params['method']} within "
                                  f"{self._timeout_s:g} s (rollout.weights_wait_timeout_s)")
        return sock_recv(sock)


def _alive(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
