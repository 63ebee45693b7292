"""Other projects' weight-transfer engines, driven as their users drive them, for ``disagg bench
vllm-sync --peer``. Each runs on both sides (the trainer's and vLLM's worker), so it lives here,
below ``trainer``, ``rollout`` and ``bench``, and imports none of them."""
