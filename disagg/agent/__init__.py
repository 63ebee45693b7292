"""The multi-turn tool-calling agent: tools the policy calls mid-rollout."""
