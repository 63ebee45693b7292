"""The vLLM engine's package: every module of disagg that imports vLLM lives here (``api``: each
difference between vLLM releases and every call into its engine; ``transfer``: the weight-transfer
backend and worker extension vLLM's workers load; ``plugin``: what vLLM's plugin loader runs in its
processes; ``tool_parsing``: vLLM's tool-call parsers). The engine actor (``rollout/engine.py``)
reaches vLLM only through these, so a second engine gets a package beside this one. Importing this
package imports nothing of vLLM's."""
