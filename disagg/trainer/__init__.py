"""Trainer workers: HF model, GRPO loss, optimizer, weight sender."""
