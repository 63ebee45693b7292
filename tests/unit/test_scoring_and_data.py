"""Scoring (rewards, advantages, drops) and data-file loading. The engine
results here are hand-built GenResults: the scorer's unit, not a feature test
of the engine (tests/integration covers the real engine)."""

import json
import logging

import pytest

from disagg.config import AlgorithmConfig
from disagg.errors import ConfigError
from disagg.rollout.types import Completion, GenResult
from disagg.scoring import Scorer
from disagg.tasks import get_reward
from disagg.tasks.files import FilePromptSource
from disagg.tasks.reverse import ReverseDigitsSource, reverse_digits_reward

ALGO = AlgorithmConfig(group_size=2, prompts_per_step=2)


def _result(rid, texts, dropped=None):
    comps = [Completion([ord(c) for c in t], [-0.5] * len(t), "stop") for t in texts]
    return GenResult(rid, 0, [1, 2], comps, 3, 3, dropped=dropped)


def _decode(ids):
    return "".join(chr(i) for i in ids)


def test_reverse_reward_per_position_credit_halved_on_wrong_length():
    row = {"answer": "4321"}
    assert reverse_digits_reward("4321", row) == 1.0
    assert reverse_digits_reward("4301", row) == 0.75
    assert reverse_digits_reward("43", row) == 0.25
    assert reverse_digits_reward("", row) == 0.0


def test_scorer_builds_samples_with_group_advantages():
    s = Scorer(reverse_digits_reward, _decode, ALGO)
    b = s.score([_result("a", ["21", "12"])], [{"answer": "21"}])
    assert [x.reward for x in b.samples] == [1.0, 0.0]
    assert b.samples[0].advantage > 0 > b.samples[1].advantage
    assert b.samples[0].policy_version == 3 and b.samples[0].prompt_ids == [1, 2]
    assert b.samples[0].behaviour_logprobs == [-0.5, -0.5]


def test_scorer_counts_drops_and_reward_errors_without_failing(caplog):
    calls = []

    def flaky(text, row):
        calls.append(text)
        if text == "boom":
            raise RuntimeError("reward bug")
        return 1.0

    s = Scorer(flaky, _decode, ALGO)
    results = [_result("a", [], dropped="prompt_too_long"), _result("b", ["boom", "ok"]), _result("c", ["boom", "x"]),
               _result("d", ["only-one"])]
    with caplog.at_level(logging.ERROR, logger="disagg.scoring"):
        b = s.score(results, [{}, {}, {}, {}])
    assert b.counts["dropped_prompt_too_long"] == 1
    assert b.counts["reward_errors"] == 2
    assert b.counts["dropped_incomplete_group"] == 1
    assert len(b.samples) == 4 and sorted(x.reward for x in b.samples) == [0.0, 0.0, 1.0, 1.0]
    assert sum("reward bug" in r.getMessage() for r in caplog.records) == 1  # traceback logged once


def test_reward_lookup_by_name_and_path():
    assert get_reward("reverse_digits", None) is reverse_digits_reward
    assert get_reward(None, "disagg.tasks.reverse:reverse_digits_reward") is reverse_digits_reward
    with pytest.raises(ConfigError, match="reward.name='nope'"):
        get_reward("nope", None)
    with pytest.raises(ConfigError, match="reward.path='nomodule_xyz:f'"):
        get_reward(None, "nomodule_xyz:f")
    with pytest.raises(ConfigError, match="module:function"):
        get_reward(None, "justamodule")


def test_file_source_skips_and_counts_malformed_rows(tmp_path):
    p = tmp_path / "data.jsonl"
    rows = [{"prompt": "12=", "answer": "21"}, "not json {", {"question": "no prompt"}, {"prompt": ""},
            {"prompt": "34=", "answer": "43"}, [1, 2]]
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    src = FilePromptSource([str(p)], "prompt", seed=0, shuffle=False)
    assert src.skipped == {"bad_json": 2, "missing_prompt": 2}
    it = iter(src)
    got = [next(it) for _ in range(4)]
    assert [g.prompt for g in got] == ["12=", "34=", "12=", "34="]
    assert got[1].row["answer"] == "43" and got[3].index == 3


def test_file_source_parquet_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["1=", "2="], "answer": ["1", "2"]}), p)
    src = FilePromptSource([str(p)], "q", seed=0, shuffle=True)
    it = iter(src)
    assert sorted(next(it).prompt for _ in range(2)) == ["1=", "2="] and src.num_skipped == 0
    with pytest.raises(ConfigError, match="does not exist"):
        FilePromptSource([str(tmp_path / "missing.jsonl")], "prompt", 0)
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"x": 1}\n')
    with pytest.raises(ConfigError, match="no usable rows"):
        FilePromptSource([str(empty)], "prompt", 0)


def test_reverse_source_is_deterministic_and_resumable():
    a = ReverseDigitsSource(4, seed=5)
    first = [next(iter(a)) for _ in range(1)][0]
    again = ReverseDigitsSource(4, seed=5)
    assert next(iter(again)).prompt == first.prompt
    resumed = ReverseDigitsSource(4, seed=5, start=10)
    ref = ReverseDigitsSource(4, seed=5)
    it = iter(ref)
    tenth = [next(it) for _ in range(11)][-1]
    assert next(iter(resumed)).prompt == tenth.prompt
    assert first.row["answer"] == first.prompt[:-1][::-1]
