"""The trajectory layout and the agent client's defaults (no Ray, no vLLM)."""

import json

import pytest

from disagg.agent.format import ChatFormat
from disagg.agent.tools import ToolRegistry
from disagg.model.tiny import build_tokenizer


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(build_tokenizer())


def test_token_layout_equals_the_chat_template_of_the_whole_conversation(fmt):
    """Prompt + the assistant's tokens + the tool turn tokenised once is the conversation the chat
    template renders (what an OpenAI client of the engine would send), token for token."""
    tools = ToolRegistry.from_config(["calculator"]).openai_tools()
    user = [{"role": "user", "content": "what is 4821*7733?"}]
    call = {"name": "calculator", "arguments": {"expression": "4821*7733"}}
    assistant = fmt.encode(f"<tool_call>{json.dumps(call)}</tool_call>") + [fmt.end_of_turn_id]
    ids = fmt.prompt_ids(user, tools) + assistant + fmt.tool_turn_ids(["37280793", "error: x"])
    conversation = user + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": "c0", "content": "37280793"},
        {"role": "tool", "tool_call_id": "c1", "content": "error: x"},
    ]
    rendered = fmt.tok.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ids == fmt.encode(rendered)
    assert fmt.decode(fmt.tool_turn_ids(["5"])) == "\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_round_trips_whitespace_and_tags_through_transformers_autotokenizer(tmp_path):
    """Saved and reloaded the way vLLM and the trainer load it (transformers picks Qwen2Tokenizer for
    a qwen2 model), the tokenizer keeps spaces, newlines and the tool tags as single tokens."""
    from transformers import AutoTokenizer

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = '<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<tool_call>{"name": "calculator"}</tool_call>'
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert len(tok.encode("<tool_call> \n", add_special_tokens=False)) == 3


def test_agent_client_has_no_timeout_and_no_retries_unless_configured():
    from disagg.agent.client import RoutedCompletions
    from disagg.config import AgentConfig

    default = AgentConfig()
    c = RoutedCompletions({0: "http://127.0.0.1:1"}, "policy", timeout_s=default.client_timeout_s,
                          max_retries=default.client_max_retries)
    assert c.clients[0].timeout is None and c.clients[0].max_retries == 0
    c = RoutedCompletions({0: "http://127.0.0.1:1", 1: "http://127.0.0.1:2"}, "policy", timeout_s=7.5, max_retries=2)
    assert all(x.timeout == 7.5 and x.max_retries == 2 for x in c.clients.values())
    assert sorted(c.router.health) == [0, 1]
