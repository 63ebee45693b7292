"""disagg: a disaggregated actor/rollout cluster for RL post-training of LLMs.

Importing the package must stay light: no vLLM, no GPU, no gRPC.
"""

__version__ = "0.1.0"
