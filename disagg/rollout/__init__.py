"""Rollout engines (vLLM) and the pool that drives them. Only engine modules import vLLM."""
