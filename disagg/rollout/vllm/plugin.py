"""vLLM general-plugin hook (entry point ``vllm.general_plugins``).

vLLM calls ``register`` in every one of its processes. It records where the
``disagg`` weight-transfer backend lives (the backend module is imported lazily
when an engine is created with ``weight_transfer_config={"backend": "disagg"}``),
adds the engine core's utility that counts each request's tokens
(``vllm_api.install_output_counts``) and, on CPU, the clean engine core's quick exit
(``vllm_api.install_quick_exit``)."""

BACKEND_NAME = "disagg"


def register() -> None:
    from disagg.rollout.vllm.api import install_output_counts, install_quick_exit, register_transfer_backend

    register_transfer_backend(BACKEND_NAME, "disagg.rollout.vllm.transfer", "DisaggWeightTransferEngine")
    try:  # the engine core's count of each request's tokens, asked at keep-mode pauses
        install_output_counts()
    except Exception as e:  # noqa: BLE001 - never stop vLLM from starting: a keep-mode sync then names it
        import logging

        logging.getLogger("disagg.rollout").warning("disagg: no token counts in this vLLM process (%s); "
                                                    "rollout.in_flight_at_sync=keep needs them", e)
    try:  # a CPU engine core that shut down cleanly leaves without the interpreter's teardown
        install_quick_exit()
    except Exception as e:  # noqa: BLE001 - only an engine's exit gets slower
        import logging

        logging.getLogger("disagg.rollout").warning("disagg: engine cores exit the slow way (%s)", e)
