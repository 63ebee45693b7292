"""vLLM's tool-call parser for the model family, used by the agent loop on generated text.

The same parser the engines' chat endpoint uses (``rollout.tool_call_parser``,
``hermes`` for Qwen2), so a trajectory is read exactly as an OpenAI client of
the engine would see it. What the parser cannot read (bad JSON, a call without
a name) is reported as a malformed call, which the agent loop turns into a tool
error message in the conversation.

This module imports vLLM (``disagg.rollout.vllm`` holds every module that does).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as in the OpenAI tools format


@dataclass
class ParsedTurn:
    content: str  # the text outside tool calls
    calls: list[ParsedCall]
    malformed: str | None = None  # why a turn that tried to call a tool could not be read


class ToolCallParser:
    """``parse(text) -> ParsedTurn`` with vLLM's registered parser ``name``."""

    def __init__(self, name: str, tokenizer, tools: list[dict]) -> None:
        from disagg.rollout.vllm import api as vllm_api

        cls, self._request = vllm_api.tool_parser(name, tools)
        self._tokenizer, self._cls = tokenizer, cls
        self.start_tag = getattr(cls, "tool_call_start_token", None) or "<tool_call>"
        # A malformed call is expected model output during RL, reported per trajectory; the
        # parser's own traceback for each one would flood the log.
        logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)

    def parse(self, text: str) -> ParsedTurn:
        parser = self._cls(self._tokenizer, None)  # parsers keep streaming state: one per turn
        info = parser.extract_tool_calls(text, self._request)
        if info.tools_called:
            calls = [ParsedCall(c.function.name, c.function.arguments) for c in info.tool_calls]
            return ParsedTurn(info.content or "", calls)
        if self.start_tag in text:
            return ParsedTurn(text[: text.find(self.start_tag)], [], malformed=_why(text, self.start_tag))
        return ParsedTurn(info.content if info.content is not None else text, [])


def _why(text: str, start_tag: str) -> str:
    body = text[text.find(start_tag) + len(start_tag):]
    end = body.find("</")
    body = (body[:end] if end >= 0 else body).strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:80]!r}"
    if not isinstance(obj, dict) or "name" not in obj:
        return f'tool call must be {{"name": ..., "arguments": {{...}}}}, got {body[:80]!r}'
    return f"tool call could not be parsed: {body[:80]!r}"
