"""vLLM general-plugin hook (entry point ``vllm.general_plugins``).

vLLM calls ``register`` in every one of its processes. It only records where
the ``disagg`` weight-transfer backend lives; the backend module is imported
lazily when an engine is created with ``weight_transfer_config={"backend": "disagg"}``.
"""

BACKEND_NAME = "disagg"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "disagg.rollout.vllm_transfer", "DisaggWeightTransferEngine"
        )
