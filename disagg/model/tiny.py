"""The embedded default model: a tiny Qwen2-architecture LM and a char tokenizer.

Nothing can be downloaded, so the default run builds its base model here: a
random-init Qwen2 (vLLM's CPU attention needs head_dim 32/64/128) plus a
character-level tokenizer saved with ``save_pretrained`` so that vLLM and HF load
the same directory. The warm start (``warmstart.py``) turns this into the
"pretrained checkpoint" that RL starts from.
"""

from __future__ import annotations

import string
from pathlib import Path

from disagg.config import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = string.digits + string.ascii_lowercase + " +-*=:?.,()#"


def vocab() -> list[str]:
    return SPECIAL_TOKENS + list(CHARS)


def build_tokenizer():
    """A char-level ``PreTrainedTokenizerFast``: one token per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    toks = vocab()
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def build_model(spec: TinyModelConfig, seed: int):
    """A randomly initialised ``Qwen2ForCausalLM`` of ``spec``'s shape (fp32, tied embeddings)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    n_vocab = len(vocab())
    cfg = Qwen2Config(
        vocab_size=n_vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
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
    model.generation_config.eos_token_id = 2
    return model


def save_checkpoint(model, tokenizer, path: Path) -> None:
    """Save model (safetensors) and tokenizer so vLLM and HF can both load ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
