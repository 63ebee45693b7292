"""Model helpers: the tiny embedded model, tokenizer and warm start."""
