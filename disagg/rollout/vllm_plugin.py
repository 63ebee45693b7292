"""vLLM general-plugin hook (entry point ``vllm.general_plugins``).

vLLM calls ``register`` in every one of its processes. It only records where
the ``disagg`` weight-transfer backend lives; the backend module is imported
lazily when an engine is created with ``weight_transfer_config={"backend": "disagg"}``.
"""

BACKEND_NAME = "disagg"


def register() -> None:
    from disagg.rollout.vllm_api import register_transfer_backend

    register_transfer_backend(BACKEND_NAME, "disagg.rollout.vllm_transfer", "DisaggWeightTransferEngine")
