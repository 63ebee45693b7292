"""vLLM behind the engine seam (``disagg.rollout.backend.EngineBackend``): one ``AsyncLLM`` with
disagg's weight-transfer backend and worker extension, each call made as ``api`` says this vLLM
release takes it."""

from __future__ import annotations

import time
from typing import Any

from disagg.config import RolloutConfig
from disagg.rollout.types import EngineOutput
from disagg.rollout.vllm import api

WORKER_EXTENSION = "disagg.rollout.vllm.transfer.DisaggWorkerExtension"


class VllmBackend:
    """``EngineBackend`` over vLLM's ``AsyncLLM`` (``engine``)."""

    def __init__(self, engine, model_path: str, import_s: float | None = None) -> None:
        self.engine, self.model_path = engine, model_path
        self.name = f"vLLM {api.vllm_version()}"
        self.import_s = import_s  # seconds to import vLLM's engine (start)

    @classmethod
    def start(cls, cfg: RolloutConfig, model_path: str, seed: int) -> "VllmBackend":
        """vLLM on ``cfg.load_format`` weights (dummy: every weight comes by a sync)."""
        t = time.perf_counter()
        api.import_engine()  # timed apart: on a fresh machine most of an engine's start before vLLM's first line
        import_s = time.perf_counter() - t
        return cls(api.start_engine(dict(
            model=model_path,
            load_format=cfg.load_format,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            **api.memory_args(cfg.gpu_memory_utilization),
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            **api.compilation_args(cfg.max_cudagraph_capture_size, None if cfg.enforce_eager else cfg.compile),
            tensor_parallel_size=cfg.tensor_parallel_size,
            distributed_executor_backend=api.executor_backend(cfg.tensor_parallel_size),
            seed=seed,
            logprobs_mode="processed_logprobs",
            weight_transfer_config={"backend": "disagg"},
            worker_extension_cls=WORKER_EXTENSION,
            # Stats feed vLLM's Prometheus metrics, served at the OpenAI server's /metrics; nothing
            # calls do_log_stats, so they are never printed.
            disable_log_stats=not cfg.openai_api,
        )), model_path, import_s)

    def start_report(self) -> dict[str, Any]:
        return {"vllm_version": api.vllm_version(), "kv_block_size": api.kv_block_size(self.engine),
                "engine_core_start": api.engine_core_start(self.engine),
                "cudagraph_max_size": api.cudagraph_max_size(self.engine), "import_s": self.import_s}

    async def token_version_sources(self) -> list[str]:
        # vLLM's labels (0.32), the engine core's counts at each pause (disagg's plugin)
        return [name for name, has in (("labels", api.labels_token_versions(self.engine)),
                                       ("counts", await api.has_output_counts(self.engine))) if has]

    def sampling(self, **kw) -> Any:
        return api.sampling_params(**kw)

    async def submit(self, request_id: str, prompt_ids: list[int], params: Any, cache_salt: str) -> Any:
        return await api.submit(self.engine, request_id, prompt_ids, params, cache_salt)

    async def final_output(self, handle: Any) -> EngineOutput:
        return await api.final_output(self.engine, handle)

    async def abort(self, request_ids: list[str]) -> None:
        await self.engine.abort(request_ids)

    def num_unfinished(self) -> int:
        return api.num_unfinished_requests(self.engine)

    def tokens_generated(self) -> int | None:
        """vLLM's own count of generated tokens in this process (its Prometheus counter)."""
        return api.generation_tokens()

    async def pause_in_place(self) -> None:
        # AsyncLLM.pause_generation is this call plus a 20 ms sleep that only lets outputs of aborted
        # or drained requests arrive first (vLLM: "not required for correctness"); the sleep was a
        # fifth of a long-tail step's time.
        await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def output_counts(self) -> dict[str, int]:
        return await api.output_counts(self.engine)

    def sample_of(self, internal_id: str, live: set[str]) -> tuple[str, int] | None:
        return api.sample_of(internal_id, live)

    async def join_transport(self, info: dict[str, Any]) -> None:
        await api.init_weight_transfer(self.engine, info)

    async def load_weights(self, update_info: dict[str, Any], policy_version: int) -> dict[str, Any]:
        return await api.sync_weights(self.engine, update_info, policy_version)

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def set_served_version(self, policy_version: int) -> None:
        await api.set_served_version(self.engine, policy_version)

    async def served_version(self) -> str | None:
        return await api.served_weight_version(self.engine)

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def worker_call(self, method: str, *args: Any) -> list[Any]:
        return list(await self.engine.collective_rpc(method, args=args))

    async def openai_app(self, served_model_name: str, tool_call_parser: str | None) -> Any:
        return await api.openai_app(self.engine, self.model_path, served_model_name, tool_call_parser)

    async def peer_weight_update(self, update_info: dict[str, Any]) -> None:
        """The benchmarks: a weight update through vLLM's own weight-transfer engine."""
        await api.peer_weight_update(self.engine, update_info)

    def shutdown(self) -> None:
        self.engine.shutdown()
