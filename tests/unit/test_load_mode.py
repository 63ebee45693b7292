"""``transport.load``: which way an engine's worker loads what it receives (pure, no engine).

vLLM's worker says that loads into its live parameters miss what the kernels read on CPU (its
linear layers repack) and for quantised models, and it has a layerwise reload; an engine without one
(SGLang's hook) can only load directly."""

from __future__ import annotations

import pytest

from disagg.transport.model_receiver import resolve_load_mode

CPU = "a cpu worker (its linear layers repack their weights)"
QUANTISED = "a quantised model"


@pytest.mark.parametrize(("requested", "why_not_direct", "reloads", "mode"), [
    ("auto", None, True, "direct"),  # vLLM on a GPU, unquantised
    ("auto", CPU, True, "layerwise"),
    ("auto", QUANTISED, True, "layerwise"),
    ("layerwise", None, True, "layerwise"),
    ("direct", None, True, "direct"),
    ("auto", None, False, "direct"),  # an engine with no layerwise reload
    ("direct", None, False, "direct"),
])
def test_auto_loads_directly_where_the_kernels_read_the_parameters_and_layerwise_elsewhere(
        requested, why_not_direct, reloads, mode):
    assert resolve_load_mode(requested, why_not_direct, reloads, "vLLM") == mode


def test_direct_where_it_would_be_wrong_and_unknown_modes_are_named():
    with pytest.raises(ValueError, match=r"transport.load='direct' cannot load into a cpu worker .*'layerwise' or"):
        resolve_load_mode("direct", CPU, True, "vLLM")
    with pytest.raises(ValueError, match="transport.load='direct' cannot load into a quantised model"):
        resolve_load_mode("direct", QUANTISED, True, "vLLM")
    with pytest.raises(ValueError, match="transport.load must be auto, layerwise or direct, got 'fast'"):
        resolve_load_mode("fast", None, True, "vLLM")


def test_an_engine_without_a_layerwise_reload_refuses_every_mode_that_needs_one_naming_the_option():
    with pytest.raises(ValueError, match="transport.load='layerwise' needs a layerwise reload, which SGLang does "
                                         "not have: use 'direct'"):
        resolve_load_mode("layerwise", None, False, "SGLang")
    with pytest.raises(ValueError, match=r"transport.load='auto' needs a layerwise reload \(what 'auto' picks for "
                                         r"a quantised model\), which SGLang does not have: no other mode loads it"):
        resolve_load_mode("auto", QUANTISED, False, "SGLang")
    with pytest.raises(ValueError, match="cannot load into a quantised model: SGLang has no layerwise reload"):
        resolve_load_mode("direct", QUANTISED, False, "SGLang")
