"""The agent runner: a Ray actor that turns prompt groups into multi-turn trajectories.

The pipeline hands it a group (the first messages of one prompt, ``n``
samples); each sample is one session, a trajectory run by ``run_trajectory``
against the engines' OpenAI API, placed by the chat scheduler (least in flight,
session-sticky). The answer has the shape of an engine's ``GenResult``, so the
pipeline's staleness bound, streaming batches and reward workers apply to
trajectories unchanged; each completion adds the loss mask (tool tokens 0) and
the text the reward reads: the whole trajectory after the prompt, tool calls and
tool responses included (special tokens kept), so a reward can check tool use.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections import Counter
from typing import Any

from disagg.agent.client import EngineAuth
from disagg.config import AgentConfig
from disagg.rollout.types import Completion, GenResult, SamplingSpec
from disagg.storage import local_copy

log = logging.getLogger("disagg.agent")


class AgentRunner:
    """Wrapped with ``ray.remote`` (async, many groups at once) by the pipeline."""

    def __init__(self, cfg: AgentConfig, model_path: str, addresses: dict[int, str], served_model_name: str,
                 tool_call_parser: str, max_model_len: int, log_level: str = "INFO",
                 cache_dir: str = "~/.cache/disagg", require_sandbox_isolation: bool = False,
                 auth: EngineAuth | None = None) -> None:
        from transformers import AutoTokenizer

        from disagg.agent.client import RoutedCompletions
        from disagg.agent.format import ChatFormat
        from disagg.agent.loop import AgentLimits
        from disagg.agent.tools import ToolRegistry
        from disagg.logs import setup_logging
        from disagg.rollout.vllm.tool_parsing import ToolCallParser

        setup_logging("agent", log_level, actor=True)
        if require_sandbox_isolation and "python" in cfg.tools:
            from disagg.sandbox import require_filesystem_isolation

            require_filesystem_isolation()
        tok = AutoTokenizer.from_pretrained(local_copy(model_path, cache_dir))  # a checkpoint at a URL: copied here
        self.fmt = ChatFormat(tok)
        self.tools = ToolRegistry.from_config(list(cfg.tools), python_timeout_s=cfg.python_timeout_s,
                                              max_result_chars=cfg.max_tool_result_chars)
        self.parser = ToolCallParser(tool_call_parser, tok, self.tools.openai_tools())
        self.llm = RoutedCompletions({int(k): v for k, v in addresses.items()}, served_model_name,
                                     timeout_s=cfg.client_timeout_s, max_retries=cfg.client_max_retries, auth=auth)
        self.limits = AgentLimits(cfg.max_turns, cfg.max_tokens_per_turn, cfg.max_trajectory_tokens, max_model_len)
        self.counts: Counter = Counter()
        self._logged: set[str] = set()

    async def run_group(self, gid: int, messages: list[dict[str, Any]], sampling: SamplingSpec) -> list[GenResult]:
        """``sampling.n`` trajectories from ``messages`` (one session each), as one GenResult."""
        from disagg.agent.loop import run_trajectory

        prompt = self.fmt.prompt_ids(messages, self.tools.openai_tools())
        if len(prompt) >= self.limits.max_model_len:
            self.counts["dropped_prompt_too_long"] += 1
            return [GenResult(f"g{gid}", -1, prompt, dropped="prompt_too_long",
                              detail=f"prompt of {len(prompt)} tokens >= rollout.max_model_len")]
        one = SamplingSpec(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                           greedy=sampling.greedy, seed=sampling.seed)
        sessions = [f"g{gid}-{i}" for i in range(sampling.n)]
        try:
            trajs = await asyncio.gather(*(run_trajectory(self.llm, self.fmt, self.parser, self.tools, prompt, one,
                                                          self.limits, s) for s in sessions))
        except Exception as e:  # noqa: BLE001 - one group's failure is counted and reported, the run goes on
            kind = type(e).__name__
            if _engine_unreachable(e):  # the engine died under the session: the driver runs the group again
                self.counts["engine_unreachable"] += 1
                return [GenResult(f"g{gid}", -1, prompt, dropped="engine_unreachable", detail=f"{kind}: {e}"[:300])]
            self.counts["dropped_agent_error"] += 1
            if kind not in self._logged:
                self._logged.add(kind)
                log.error("group %d failed with %s (dropped; further %s failures only counted):\n%s", gid, kind,
                          kind, traceback.format_exc())
            return [GenResult(f"g{gid}", -1, prompt, dropped="agent_error", detail=f"{kind}: {e}"[:300])]
        finally:
            for s in sessions:
                self.llm.router.end_session(s)
        comps = []
        for t in trajs:
            info = dict(t.counts, turns=t.num_turns, **{f"finish_{t.finish_reason}": 1})
            comps.append(Completion(t.response_ids, t.logprobs, t.finish_reason, t.token_versions,
                                    loss_mask=t.loss_mask, final_text=self.fmt.decode(t.response_ids), info=info))
            self.counts.update(t.counts)
        versions = [v for t in trajs for v in t.token_versions]
        return [GenResult(f"g{gid}", trajs[0].engines[0] if trajs[0].engines else -1, prompt, comps,
                          min(versions, default=0), max((t.max_version for t in trajs), default=0))]

    async def set_engine_health(self, engine_id: int, health: str) -> None:
        self.llm.router.set_health(engine_id, health)

    async def add_engine(self, engine_id: int, address: str) -> None:
        self.llm.add_engine(engine_id, address)

    async def remove_engine(self, engine_id: int) -> None:
        await self.llm.remove_engine(engine_id)

    async def engine_use(self, engine_id: int) -> int:
        """Requests in flight on ``engine_id`` plus sessions pinned to it (0: it may leave)."""
        r = self.llm.router
        return r.inflight[engine_id] + sum(1 for e in r.sessions.values() if e == engine_id)

    async def get_stats(self) -> dict[str, Any]:
        r = self.llm.router
        return {"requests_per_engine": dict(r.requests), "inflight_per_engine": dict(r.inflight),
                "moved_sessions": r.moved_sessions, **self.counts, **{f"tool_{k}": v for k, v in self.tools.counts.items()}}


def _engine_unreachable(e: BaseException) -> bool:
    """The OpenAI client could not reach its engine, or the engine's model process is dead."""
    import openai

    return isinstance(e, (openai.APIConnectionError, openai.InternalServerError))
