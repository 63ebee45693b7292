"""How the engine reads vLLM's per-token log-probs (real vLLM containers, no engine)."""

from __future__ import annotations

import pytest

from disagg.rollout.vllm.api import sampled_logprobs as _sampled_logprobs


def _positions(ids, lps, extra=None):
    """vLLM's list form: one {token id: Logprob} per position (``extra``: a top-k entry too)."""
    from vllm.logprobs import Logprob

    out = []
    for t, lp in zip(ids, lps):
        pos = {t: Logprob(logprob=lp, rank=2)}
        if extra is not None:
            pos[extra] = Logprob(logprob=-0.01, rank=1)
        out.append(pos)
    return out


def test_flat_logprobs_give_the_sampled_tokens_log_probs_in_order():
    from vllm.logprobs import FlatLogprobs

    ids, lps = [5, 9, 5, 7], [-0.5, -1.25, -0.75, -3.0]
    flat = FlatLogprobs()
    flat.extend(_positions(ids, lps))
    assert _sampled_logprobs(flat, ids) == lps


@pytest.mark.parametrize("flat", [False, True])
def test_positions_holding_more_than_the_sampled_token_are_looked_up_by_id(flat):
    from vllm.logprobs import FlatLogprobs

    ids, lps = [5, 9, 7], [-0.5, -1.25, -3.0]
    positions = _positions(ids, lps, extra=3)  # top-1 token 3 stored beside each sampled one
    if flat:
        positions, built = FlatLogprobs(), positions
        positions.extend(built)
    assert _sampled_logprobs(positions, ids) == lps


def test_no_log_probs_give_an_empty_list():
    assert _sampled_logprobs(None, [1, 2]) == []
