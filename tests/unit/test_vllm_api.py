"""The vLLM adapter's pure parts: per-token versions from vLLM's spans (where a release labels
tokens) and the choice of what a sync does with requests in flight."""

from types import SimpleNamespace as NS

import pytest

from disagg.errors import ConfigError, RolloutError
from disagg.rollout.vllm_api import resolve_in_flight_mode, token_versions


def test_token_versions_come_from_the_engine_weight_version_spans():
    spans = [NS(version="4", start=0, end=3), NS(version="5", start=3, end=4), NS(version="7", start=4, end=6)]
    assert token_versions("r", NS(weight_versions=spans), 6) == [4, 4, 4, 5, 7, 7]
    assert token_versions("r", NS(weight_versions=None), 0) == []  # nothing sampled, nothing labelled
    with pytest.raises(RolloutError, match="6 tokens but weight-version spans cover 4"):
        token_versions("r", NS(weight_versions=spans[:2]), 6)
    with pytest.raises(RolloutError, match="6 tokens but weight-version spans cover 0"):
        token_versions("r", NS(weight_versions=None), 6)
    with pytest.raises(RolloutError, match="not contiguous"):
        token_versions("r", NS(weight_versions=[spans[0], spans[2]]), 5)
    with pytest.raises(RolloutError, match="labelled 'default'"):
        token_versions("r", NS(weight_versions=[NS(version="default", start=0, end=2)]), 2)


def test_a_vllm_without_labels_gives_no_token_versions():
    """vLLM 0.26's CompletionOutput has no weight_versions field at all."""
    assert token_versions("r", NS(token_ids=[1, 2]), 2) is None


@pytest.mark.parametrize("requested, labels, mode", [
    ("auto", True, "keep"), ("auto", False, "resubmit"),
    ("keep", True, "keep"), ("resubmit", True, "resubmit"), ("resubmit", False, "resubmit"),
])
def test_in_flight_mode(requested, labels, mode):
    assert resolve_in_flight_mode(requested, labels) == mode


def test_keep_on_a_vllm_without_labels_is_a_config_error(monkeypatch):
    import disagg.rollout.vllm_api as api

    monkeypatch.setattr(api, "vllm_version", lambda: "0.26.0")
    with pytest.raises(ConfigError, match=r"rollout.in_flight_at_sync='keep'.*vLLM 0.26.0.*'resubmit'"):
        resolve_in_flight_mode("keep", False)


def test_a_tool_parser_vllm_does_not_have_is_a_config_error_naming_the_key_and_the_known_ones():
    pytest.importorskip("vllm")
    from disagg.rollout.vllm_api import tool_parser, tool_parser_class

    cls, request = tool_parser("hermes", [{"type": "function", "function": {"name": "calc", "parameters": {}}}])
    assert hasattr(cls, "extract_tool_calls") and request.tools[0].function.name == "calc"
    assert tool_parser_class("hermes") is cls  # the server's check at start: no request built
    for check in (lambda: tool_parser("nonsense", None), lambda: tool_parser_class("nonsense")):
        with pytest.raises(ConfigError, match=r"rollout.tool_call_parser='nonsense': vLLM has no such tool parser; "
                                              r"known: \[.*'hermes'"):
            check()
