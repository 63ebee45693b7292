"""The embedded default model: a tiny Qwen2-architecture LM and a char tokenizer.

Nothing can be downloaded, so the default run builds its base model here: a
random-init Qwen2 (vLLM's CPU attention needs head_dim 32/64/128) plus a
character-level tokenizer saved with ``save_pretrained`` so that vLLM and HF load
the same directory. The warm start (``warmstart.py``) turns this into the
"pretrained checkpoint" that RL starts from.

The tokenizer also speaks the Qwen/Hermes chat and tool-calling format
(``<|im_start|>``/``<|im_end|>`` turns, ``<tool_call>`` / ``<tool_response>``
tags, one token each) with a compact chat template, so vLLM's OpenAI chat
endpoint and its ``hermes`` tool parser work on the tiny model as on a real
Qwen2 checkpoint. The vocabulary itself is ``disagg/vocab.py``.
"""

from __future__ import annotations

from pathlib import Path

from disagg.config import TinyModelConfig
from disagg.vocab import IM_END, IM_START, TOOL_TAGS, vocab

_BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}  # GPT-2 byte-level symbols; other printable ASCII maps to itself

# Qwen2.5's turn format with a one-line tool list (the model is too small for JSON schemas
# in its prompt). Tool responses go in a user turn, each in <tool_response> tags; an
# assistant's tool calls are <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
# what vLLM's hermes parser reads.
CHAT_TEMPLATE = (
    "{% if tools or messages[0].role == 'system' %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% if tools %}\n{% endif %}{% endif %}"
    "{% if tools %}tools:"
    "{% for t in tools %}{% set f = t.function if t.function is defined else t %}"
    " {{ f.name }}({{ (f.parameters.properties if f.parameters is defined and f.parameters.properties is defined"
    " else {}) | list | join(',') }})"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in (m.tool_calls or []) %}{% set f = tc.function if tc.function is defined else tc %}"
    "<tool_call>{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>{{ m.content }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """A char-level ``PreTrainedTokenizerFast``: one token per character."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenizers import AddedToken

    # Byte-level symbols and a BPE model without merges: one token per character, and exactly
    # what transformers' Qwen2Tokenizer rebuilds from tokenizer.json (AutoTokenizer and vLLM pick
    # that class for a qwen2 model); a plain char vocabulary would lose spaces and newlines there.
    toks = [_BYTE_LEVEL.get(t, t) for t in vocab()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=[], unk_token="<unk>",
                               fuse_unk=False, byte_fallback=False))
    # Turn markers are special (dropped by skip_special_tokens); tool tags are plain added
    # tokens so they survive decoding and the tool parser sees them.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in [IM_START, IM_END]])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TAGS])
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def build_model(spec: TinyModelConfig, seed: int):
    """A randomly initialised ``Qwen2ForCausalLM`` of ``spec``'s shape (fp32, tied embeddings)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    n_vocab = len(vocab())
    if spec.vocab_size is not None and spec.vocab_size < n_vocab:
        raise ValueError(f"model.tiny.vocab_size={spec.vocab_size}: the tokenizer has {n_vocab} tokens")
    cfg = Qwen2Config(
        vocab_size=spec.vocab_size or n_vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads or spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 1
    # </s> ends a plain completion, <|im_end|> an assistant turn.
    model.generation_config.eos_token_id = [2, vocab().index(IM_END)]
    return model


def save_checkpoint(model, tokenizer, path: Path) -> None:
    """Save model (safetensors) and tokenizer so vLLM and HF can both load ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
