"""The token layout of a multi-turn trajectory, taken from the model's own chat template.

Token in, token out: a trajectory is the prompt (the chat template applied to
the first messages, tokenised once), then each assistant turn's tokens exactly
as the engine sampled them, then each tool turn's tokens, tokenised once and
never again. Nothing is decoded and re-encoded, so the trainer sees the same
ids the engine produced and conditioned on.

The tool turn's text is derived from the chat template rather than written per
model family: render a conversation that ends with an assistant turn, render it
again with the tool messages and the generation prompt, and the tool turn is
the difference after the assistant's end-of-turn token (the token that stops
generation, so the engine's output ends there too).
"""

from __future__ import annotations

from typing import Any

_PROBE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


class ChatFormat:
    """Prompt and tool-turn token ids for one tokenizer and its chat template."""

    def __init__(self, tokenizer, end_of_turn: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template: agent tasks need one")
        self.tok = tokenizer
        self.end_of_turn = end_of_turn or _guess_end_of_turn(tokenizer)
        eot = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        if eot is None or eot == tokenizer.unk_token_id:
            raise ValueError(f"end-of-turn token {self.end_of_turn!r} is not a single token of the tokenizer")
        self.end_of_turn_id = int(eot)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The first messages with the generation prompt, tokenised once."""
        text = self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def tool_turn_text(self, contents: list[str]) -> str:
        """What follows an assistant turn's end-of-turn token when tools answered ``contents``."""
        base = self.tok.apply_chat_template(_PROBE, tokenize=False)
        msgs = _PROBE + [{"role": "tool", "content": c, "tool_call_id": f"call_{i}"} for i, c in enumerate(contents)]
        full = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        cut = base.rfind(self.end_of_turn)
        if cut < 0 or not full.startswith(base[: cut + len(self.end_of_turn)]):
            raise ValueError(f"the chat template does not end an assistant turn with {self.end_of_turn!r} "
                             "followed by the tool turn: cannot lay out tool responses")
        return full[cut + len(self.end_of_turn):]

    def tool_turn_ids(self, contents: list[str]) -> list[int]:
        return self.encode(self.tool_turn_text(contents))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _guess_end_of_turn(tokenizer) -> str:
    for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if t in tokenizer.get_vocab():
            return t
    return tokenizer.eos_token
