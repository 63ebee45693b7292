"""``transport.load``: which way an engine's worker loads what it receives (pure, no vLLM)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from disagg.rollout.vllm.transfer import resolve_load_mode  # noqa: E402


def test_auto_loads_directly_on_gpus_and_layerwise_on_cpu_or_when_quantised():
    assert resolve_load_mode("auto", "cuda", quantized=False) == "direct"
    assert resolve_load_mode("auto", "cpu", quantized=False) == "layerwise"
    assert resolve_load_mode("auto", "cuda", quantized=True) == "layerwise"
    assert resolve_load_mode("layerwise", "cuda", quantized=False) == "layerwise"
    assert resolve_load_mode("direct", "cuda", quantized=False) == "direct"


def test_direct_where_it_would_be_wrong_and_unknown_modes_are_named():
    with pytest.raises(ValueError, match="transport.load='direct' cannot load into a cpu worker"):
        resolve_load_mode("direct", "cpu", quantized=False)
    with pytest.raises(ValueError, match="transport.load='direct' cannot load into a quantised model"):
        resolve_load_mode("direct", "cuda", quantized=True)
    with pytest.raises(ValueError, match="transport.load must be auto, layerwise or direct, got 'fast'"):
        resolve_load_mode("fast", "cuda", quantized=False)
