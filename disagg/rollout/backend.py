"""The seam between the engine actor and an inference engine.

What is disagg's own stays in the actor (``rollout/engine.py``, ``engine_receive.py``): the
weights-loaded gate, policy versions and the cuts of a response into them, resubmitted pieces, stale
drops, the coordinator's reports. What an engine does is asked of an ``EngineBackend``, one per
engine actor, made by its package's ``start`` (vLLM's: ``rollout/vllm/backend.py``): start on dummy
weights, sample, abort, pause in place and resume, load weights through disagg's transport, answer
health checks, serve the OpenAI API, shut down. Nothing here imports an engine.
"""

from __future__ import annotations

from typing import Any, Protocol

from disagg.rollout.types import EngineOutput


class EngineBackend(Protocol):
    """An inference engine as the engine actor drives it. Requests are the actor's ids; sampling
    parameters are made by ``sampling`` and only passed back to ``submit``."""

    name: str
    """The engine's name and version, for logs and start reports ('vLLM 0.32.0')."""

    def start_report(self) -> dict[str, Any]:
        """What the engine says of itself once started (cache block size, CUDA graph sizes, ...)."""

    async def token_version_sources(self) -> list[str]:
        """Where each token's weight version can come from: 'labels' (the engine labels each token),
        'counts' (it counts each request's tokens at a pause); keep mode needs one."""

    def sampling(self, *, n: int, max_tokens: int, temperature: float, top_p: float, seed: int | None,
                 ignore_eos: bool) -> Any:
        """The engine's sampling parameters: each sampled token's log-prob, token ids only, one
        output per request when it is done."""

    async def submit(self, request_id: str, prompt_ids: list[int], params: Any, cache_salt: str) -> Any:
        """Add a request; returns once ``abort`` reaches it. Its prefix-cache blocks are shared only
        with requests of the same ``cache_salt``. The handle goes to ``final_output``."""

    async def final_output(self, handle: Any) -> EngineOutput:
        """The request's output once it finished (a cancelled wait aborts it)."""

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now; each finishes with what it has ('abort')."""

    def num_unfinished(self) -> int:
        """Requests the engine holds, from any client (the OpenAI server's included)."""

    async def pause_in_place(self) -> None:
        """Freeze every request where it is (its tokens and KV kept) until ``resume``; returns with
        the engine idle."""

    async def resume(self) -> None:
        """Let frozen requests continue."""

    async def output_counts(self) -> dict[str, int]:
        """Each request's output tokens so far (asked while paused)."""

    def sample_of(self, internal_id: str, live: set[str]) -> tuple[str, int] | None:
        """(the actor's request id, sample index) of the engine's id of one sample; None: none of ``live``."""

    async def join_transport(self, info: dict[str, Any]) -> None:
        """Every model worker joins disagg's transport groups (``info``: the groups, ranks, options)."""

    async def load_weights(self, update_info: dict[str, Any], policy_version: int) -> dict[str, Any]:
        """Every model worker receives one version over the transport and loads it; the receivers'
        report. Requests then carry ``policy_version`` as their weights' label."""

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache's blocks; False where blocks are still held (frozen requests)."""

    async def set_served_version(self, policy_version: int) -> None:
        """Label the weights now loaded (a checkpoint loaded at start)."""

    async def served_version(self) -> str | None:
        """The label of the weights the engine serves."""

    async def check_health(self) -> None:
        """Raise once the engine is dead."""

    async def worker_call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every model worker (disagg's worker extension); their answers."""

    async def openai_app(self, served_model_name: str, tool_call_parser: str | None) -> Any:
        """The engine's own OpenAI-compatible ASGI app over this engine (the actor puts its gate in front)."""

    def shutdown(self) -> None:
        """Stop the engine and its processes."""
