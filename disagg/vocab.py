"""The embedded tokenizer's vocabulary: one token per character, plus chat and tool tags (pure).

Below every other module: the config's checks size the tiny model's embedding against it, and
``model/tiny.py`` builds the tokenizer from it, without the config and the model importing each
other. Token ids of the original characters never change (new ones are appended), so checkpoints
of the reverse task keep their meaning.
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = string.digits + string.ascii_lowercase + " +-*=:?.,()#"
# Appended after CHARS (ids of the above unchanged): the rest of printable ASCII and newline.
EXTRA_CHARS = "".join(c for c in string.ascii_uppercase + string.punctuation + "\n" if c not in CHARS)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def vocab() -> list[str]:
    return SPECIAL_TOKENS + list(CHARS) + list(EXTRA_CHARS) + [IM_START, IM_END] + TOOL_TAGS
