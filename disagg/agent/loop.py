"""One multi-turn tool-calling trajectory: generate, parse tool calls, run tools, repeat.

The trajectory is kept as tokens only (see ``format.py``): each assistant turn
appends the engine's token ids with their behaviour log-probs (loss mask 1);
each tool turn appends the tool responses tokenised once (loss mask 0, log-prob
placeholders 0). The next turn's prompt is exactly those tokens, so the engine
conditions on what the trainer will train on.

A turn whose tool call cannot be read, names an unknown tool or carries bad
arguments gets an error message as that tool's response - the model sees its
mistake, the run goes on. A trajectory ends when a turn calls no tool
(``stop``), a turn hits its token limit (``length``), the token budget would be
exceeded (``budget``) or after ``max_turns`` assistant turns (``max_turns``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from disagg.agent.client import TurnOutput
from disagg.agent.format import ChatFormat
from disagg.agent.tools import ToolRegistry
from disagg.rollout.types import SamplingSpec


class TurnGenerator(Protocol):
    async def complete(self, session_id: str | None, prompt_ids: list[int], max_tokens: int,
                       sampling: SamplingSpec, stop_token_ids: list[int]) -> TurnOutput: ...


class CallParser(Protocol):
    def parse(self, text: str): ...  # -> rollout.tool_parsing.ParsedTurn


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    final_text: str = ""
    finish_reason: str = ""
    num_turns: int = 0
    max_version: int = 0  # the highest version any turn may have been served by
    engines: list[int] = field(default_factory=list)  # the engine of each turn
    counts: Counter = field(default_factory=Counter)  # tool_calls, tool_errors, malformed_tool_calls, ...

    def _append(self, ids: list[int], logprobs: list[float], mask: int, version: int) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [mask] * len(ids)
        self.token_versions += [version] * len(ids)


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int
    max_tokens_per_turn: int
    max_trajectory_tokens: int
    max_model_len: int


async def run_trajectory(llm: TurnGenerator, fmt: ChatFormat, parser: CallParser, tools: ToolRegistry,
                         prompt_ids: list[int], sampling: SamplingSpec, limits: AgentLimits,
                         session_id: str) -> Trajectory:
    traj = Trajectory(list(prompt_ids))
    for _ in range(limits.max_turns):
        used = len(traj.response_ids)
        room = min(limits.max_tokens_per_turn, limits.max_trajectory_tokens - used,
                   limits.max_model_len - len(prompt_ids) - used)
        if room <= 0:
            traj.finish_reason = "budget"
            break
        out = await llm.complete(session_id, traj.prompt_ids + traj.response_ids, room, sampling,
                                 [fmt.end_of_turn_id])
        traj.num_turns += 1
        traj.engines.append(out.engine_id)
        traj.max_version = max(traj.max_version, out.version_max)
        # Tokens of a turn are tagged with the lowest version that can have produced them
        # (staleness is never under-estimated).
        traj._append(out.token_ids, out.logprobs, 1, out.version_min)
        turn = parser.parse(fmt.decode(out.token_ids))
        if out.finish_reason == "length":
            traj.finish_reason = "length"
            break
        if not turn.calls and turn.malformed is None:
            traj.final_text = fmt.decode(out.token_ids, skip_special_tokens=True).strip()
            traj.finish_reason = "stop"
            break
        results = []
        if turn.malformed is not None:
            traj.counts["malformed_tool_calls"] += 1
            results.append(f"error: {turn.malformed}")
        for call in turn.calls:
            res = tools.call(call.name, call.arguments)
            traj.counts["tool_calls"] += 1
            if not res.ok:
                traj.counts["tool_errors"] += 1
            results.append(res.content)
        tool_ids = fmt.tool_turn_ids(results)
        if len(traj.response_ids) + len(tool_ids) >= limits.max_trajectory_tokens:
            traj.finish_reason = "budget"
            break
        traj._append(tool_ids, [0.0] * len(tool_ids), 0, out.version_min)
    else:
        traj.finish_reason = "max_turns"
    return traj
