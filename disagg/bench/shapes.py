"""Model shapes the benchmarks move, by name: Qwen2 architectures with random weights.

A benchmark needs the parameter set of a real model (its number of tensors and
their sizes decide how buckets fill), not its trained values, so each shape is
only a ``Qwen2Config``. The full-size shapes follow the published Qwen2 configs;
"tiny" and "qwen2-0.5b-narrow" keep the 0.5B layout at widths a CPU can move in
seconds.

This module must never download anything or build a model: it returns configs.
"""

from __future__ import annotations

from typing import Any

# Keyword arguments of ``Qwen2Config`` per shape name.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    # The 0.5B layout (24 layers, 14 heads, 2 kv heads, tied) at a quarter of the width:
    # 29.7M parameters, 59 MB in bf16.
    "qwen2-0.5b-narrow": dict(hidden_size=224, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                              intermediate_size=1216, vocab_size=32768, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1024, tie_word_embeddings=True),
}


def shape_names() -> list[str]:
    return list(SHAPES)


def qwen2_config(name: str):
    """The ``transformers.Qwen2Config`` of shape ``name``; ``ValueError`` naming the known shapes otherwise."""
    from transformers import Qwen2Config

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return Qwen2Config(max_position_embeddings=4096, **SHAPES[name])


def num_parameters(name: str) -> int:
    """Parameter count of shape ``name`` (tied embeddings counted once). Pure arithmetic."""
    s = SHAPES[name]
    h, i, v, layers = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    head_dim = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head_dim
    attn = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o (no bias)
    layer = attn + 3 * h * i + 2 * h  # gate, up, down; two RMSNorm weights
    return v * h * (1 if s["tie_word_embeddings"] else 2) + layers * layer + h
