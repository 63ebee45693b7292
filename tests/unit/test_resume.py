"""Resume planning without Ray: which checkpoint `resume=` picks (at a path or an fsspec URL),
the checks on it, pruning, the replayed prompt stream and the metrics file a resumed run continues."""

from __future__ import annotations

import json
import posixpath
import uuid
from pathlib import Path

import pytest

from disagg import storage
from disagg.config import load_config
from disagg.errors import ConfigError
from disagg.metrics import MetricsWriter, read_metrics
from disagg.resume import (ResumableSource, complete_checkpoints, config_changes, find_checkpoint, load_resume,
                           prune_checkpoints)
from disagg.tasks.reverse import ReverseDigitsSource


def _checkpoint(run_dir: Path, step: int, partial: bool = False, **state) -> Path:
    """A checkpoint in a run directory's default place (the run's config.json written as at its start)."""
    (run_dir / "config.json").write_text(json.dumps({"trainer": {"checkpoint_dir": None}}))
    p = run_dir / "checkpoints" / (f"step_{step:06d}" + (".partial" if partial else ""))
    p.mkdir(parents=True)
    (p / "state.json").write_text(json.dumps({"step": step, "policy_version": step + 1, "data_cursor": 4 * step,
                                              **state}))
    return p


def _cfg(resume, **trainer):
    return load_config({"resume": str(resume), "trainer": {"total_steps": 20, **trainer}})


@pytest.mark.parametrize(
    "steps, partial, picked",
    [
        ([2], [], 2),
        ([2, 10, 4], [], 10),  # by step number, not by name order or creation
        ([2, 4], [6], 4),  # a writer that died: its .partial is never picked
        ([3], [1, 9], 3),
    ],
)
def test_a_run_dir_resumes_from_its_latest_complete_checkpoint(tmp_path, steps, partial, picked):
    for s in steps:
        _checkpoint(tmp_path, s)
    for s in partial:
        _checkpoint(tmp_path, s, partial=True)
    assert find_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints" / f"step_{picked:06d}")
    assert [Path(p).name for p in complete_checkpoints(str(tmp_path / "checkpoints"))] == \
        [f"step_{s:06d}" for s in sorted(steps)]


def test_a_checkpoint_dir_is_taken_as_named(tmp_path):
    ckpt = _checkpoint(tmp_path, 4)
    assert find_checkpoint(str(ckpt)) == str(ckpt)


@pytest.mark.parametrize("layout", ["empty", "only_partial", "partial_named", "missing"])
def test_no_complete_checkpoint_is_a_config_error_naming_resume_and_the_path(tmp_path, layout):
    target = tmp_path
    if layout == "only_partial":
        _checkpoint(tmp_path, 3, partial=True)
    elif layout == "partial_named":
        target = _checkpoint(tmp_path, 3, partial=True)
    elif layout == "missing":
        target = tmp_path / "nope"
    with pytest.raises(ConfigError) as e:
        find_checkpoint(str(target))
    msg = str(e.value)
    assert msg.startswith(f"resume={str(target)!r}")
    if layout == "only_partial":
        assert "step_000003.partial" in msg


def test_config_validation_names_resume_when_the_path_is_not_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="resume="):
        _cfg(tmp_path / "missing")


def test_load_resume_reads_the_state_and_maps_steps_to_versions(tmp_path):
    _checkpoint(tmp_path, 5, data_pending=[17, 19], counts={"reward_errors": 2}, base_model_path="/m",
                num_trainer_workers=2)
    point = load_resume(_cfg(tmp_path))
    assert (point.step, point.policy_version, point.first_step) == (5, 6, 6)
    assert point.run_dir == tmp_path and point.data_cursor == 20 and point.data_replay == (17, 19)
    assert point.checkpoint_dir == str(tmp_path / "checkpoints")
    assert point.counts == {"reward_errors": 2} and point.num_trainer_workers == 2


@pytest.mark.parametrize(
    "name, data, needle",
    [
        ("older", {}, "(later: step_000007)"),  # resuming step 5 would rewind over step 7
        ("latest", {"trainer": {"total_steps": 7}}, "trainer.total_steps=7"),
        ("latest", {"run_dir": "/elsewhere"}, "run_dir='/elsewhere'"),
        ("bad_version", {}, "policy_version 3"),
        ("latest", {"algorithm": {"kl_coef": 0.1}}, "algorithm.kl_coef=0.1"),  # its base model is gone
    ],
)
def test_load_resume_refuses_what_cannot_continue(tmp_path, name, data, needle):
    older = _checkpoint(tmp_path, 5)
    latest = _checkpoint(tmp_path, 7, base_model_path=str(tmp_path / "gone"),
                         **({"policy_version": 3} if name == "bad_version" else {}))
    data = {"resume": str(older if name == "older" else latest), "trainer": {"total_steps": 20}, **data}
    with pytest.raises(ConfigError) as e:
        load_resume(load_config(data))
    assert needle in str(e.value)


def test_prune_keeps_the_newest_and_the_protected_and_drops_dead_partials(tmp_path):
    ckpts = [_checkpoint(tmp_path, s) for s in (1, 2, 3, 4, 5)]
    _checkpoint(tmp_path, 6, partial=True)
    where = str(tmp_path / "checkpoints")
    assert prune_checkpoints(where, 0) == []
    gone = prune_checkpoints(where, 2, protect=str(ckpts[1]))
    assert [Path(p).name for p in gone] == ["step_000001", "step_000003", "step_000006.partial"]
    assert [Path(p).name for p in complete_checkpoints(where)] == ["step_000002", "step_000004", "step_000005"]
    assert not list((tmp_path / "checkpoints").glob("*.partial"))


@pytest.fixture
def memory_dir():
    """A fresh directory on fsspec's in-process memory filesystem."""
    where = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    yield where
    storage.remove(where)


def _checkpoint_at(where: str, step: int, complete: bool = True, **state) -> str:
    """A checkpoint under the checkpoint directory ``where`` (a path or URL), written the way
    Job.save_checkpoint writes one at a URL: files first, state.json last."""
    ckpt = storage.join(where, f"step_{step:06d}")
    storage.write_text(storage.join(ckpt, "model.safetensors"), "weights")
    if complete:
        storage.write_text(storage.join(ckpt, "state.json"), json.dumps(
            {"step": step, "policy_version": step + 1, "data_cursor": 4 * step, **state}))
    return ckpt


@pytest.mark.parametrize("kind", ["path", "file_url", "memory_url"])
def test_a_checkpoint_dir_at_a_path_or_url_resumes_from_its_latest_complete_checkpoint(tmp_path, memory_dir, kind):
    where = {"path": str(tmp_path / "ckpt"), "file_url": f"file://{tmp_path}/ckpt", "memory_url": memory_dir}[kind]
    for s in (2, 4):
        _checkpoint_at(where, s)
    _checkpoint_at(where, 6, complete=False)  # a writer that died before state.json: never picked
    storage.write_text(storage.join(where, "step_000008.partial", "x"), "")
    assert find_checkpoint(where) == storage.join(where, "step_000004")
    assert find_checkpoint(where + "/") == storage.join(where, "step_000004")
    assert [posixpath.basename(p) for p in complete_checkpoints(where)] == ["step_000002", "step_000004"]
    # Pruning there: the newest complete one and the protected one stay, every incomplete one goes.
    gone = prune_checkpoints(where, 1, protect=storage.join(where, "step_000002"))
    assert sorted(posixpath.basename(p) for p in gone) == ["step_000006", "step_000008.partial"]
    assert storage.list_dirs(where) == ["step_000002", "step_000004"]
    gone = prune_checkpoints(where, 1)
    assert [posixpath.basename(p) for p in gone] == ["step_000002"]


def test_a_url_with_only_incomplete_checkpoints_is_a_config_error_naming_them(memory_dir):
    _checkpoint_at(memory_dir, 3, complete=False)
    with pytest.raises(ConfigError) as e:
        find_checkpoint(memory_dir)
    assert str(e.value).startswith(f"resume={memory_dir!r}: no complete checkpoint")
    assert "step_000003" in str(e.value)


def test_resume_from_a_url_goes_on_in_the_run_dir_its_state_records(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    url = f"file://{tmp_path}/shared/ckpt"
    ckpt = _checkpoint_at(url, 5, run_dir=str(run_dir))
    point = load_resume(_cfg(url))
    assert (point.checkpoint, point.checkpoint_dir, point.run_dir) == (ckpt, url, run_dir)
    assert (point.step, point.policy_version) == (5, 6)
    # On a machine without that directory the resume still loads: the new run directory holds what follows.
    ckpt = _checkpoint_at(url, 7, run_dir=str(tmp_path / "elsewhere"))
    point = load_resume(_cfg(ckpt))
    assert point.checkpoint == ckpt and point.run_dir is None
    # A run directory whose config.json names a checkpoint URL resumes from the latest checkpoint there.
    (run_dir / "config.json").write_text(json.dumps({"trainer": {"checkpoint_dir": url}}))
    point = load_resume(_cfg(run_dir))
    assert (point.checkpoint, point.run_dir) == (storage.join(url, "step_000007"), run_dir)


def test_a_shared_checkpoint_dir_named_checkpoints_is_not_taken_for_a_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shared = tmp_path / "shared" / "checkpoints"  # trainer.checkpoint_dir=/shared/checkpoints
    _checkpoint_at(str(shared), 3, run_dir=str(run_dir))
    assert load_resume(_cfg(shared)).run_dir == run_dir
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        find_checkpoint(str(tmp_path / "shared"))  # no config.json: not a run directory


@pytest.mark.parametrize("key, value, needle", [
    ("resume", "memory://ckpt", "memory:// lives in one process"),
    ("trainer.checkpoint_dir", "memory://ckpt", "memory:// lives in one process"),
    ("trainer.checkpoint_dir", "nosuchfs://bucket/ckpt", "fsspec knows no protocol 'nosuchfs'"),
])
def test_checkpoint_locations_fsspec_cannot_share_are_config_errors(key, value, needle):
    section, _, name = key.rpartition(".")
    data = {"trainer": {name: value}} if section else {name: value}
    with pytest.raises(ConfigError) as e:
        load_config(data)
    assert str(e.value).startswith(f"{key}={value!r}") and needle in str(e.value)


def test_resumable_source_replays_untrained_rows_then_continues_at_the_cursor():
    # A run draws rows 0..9; groups 3 and 7 (rows 3, 7) are untrained at its checkpoint.
    first = ResumableSource(ReverseDigitsSource(4, seed=5))
    it = iter(first)
    rows = [next(it) for _ in range(10)]
    assert first.cursor == 10 and first.pending([7, 3]) == [3, 7]

    resumed = ResumableSource(ReverseDigitsSource(4, seed=5, start=first.cursor), replay=first.pending([7, 3]))
    it = iter(resumed)
    got = [next(it) for _ in range(4)]
    assert [r.index for r in got] == [3, 7, 10, 11]
    assert got[0].row == rows[3].row and got[1].row == rows[7].row
    fresh = iter(ReverseDigitsSource(4, seed=5))
    assert got[2].row == [next(fresh) for _ in range(11)][10].row
    # A checkpoint before the replay is drawn keeps it pending, with the groups now untrained.
    partial = ResumableSource(ReverseDigitsSource(4, seed=5, start=10), replay=[3, 7])
    it = iter(partial)
    next(it)
    assert partial.pending([0]) == [3, 7]


def test_every_task_source_row_at_matches_its_stream(tmp_path):
    from disagg.tasks.calculator import CalculatorSource
    from disagg.tasks.code import CodeTaskSource
    from disagg.tasks.files import FilePromptSource

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5)))
    makers = [lambda start: ReverseDigitsSource(4, 1, start), lambda start: CalculatorSource(4, 1, start),
              lambda start: CodeTaskSource(1, start),
              lambda start: FilePromptSource([str(data)], "prompt", 3, True, start)]
    for make in makers:
        src = make(0)
        it = iter(src)
        rows = [next(it) for _ in range(12)]  # the file source: more than two epochs
        assert src.cursor == 12 and [r.index for r in rows] == list(range(12))
        assert [make(0).row_at(i).row for i in range(12)] == [r.row for r in rows]
        later = make(7)
        assert next(iter(later)).row == rows[7].row and later.cursor == 8


def test_config_changes_lists_the_keys_that_differ():
    old = load_config({"trainer": {"num_workers": 1}}).to_dict()
    new = load_config({"trainer": {"num_workers": 2, "total_steps": 9}, "resume": "."}).to_dict()
    assert config_changes(old, new) == {"trainer.num_workers": [1, 2], "trainer.total_steps": [200, 9]}
    assert config_changes(json.loads(json.dumps(old)), old) == {}  # lists from JSON equal the tuples


def test_a_resumed_metrics_writer_continues_after_the_checkpoint_step(tmp_path):
    w = MetricsWriter(tmp_path)
    for s in range(1, 8):
        w.log(s, {"reward/mean": s / 10})
    w.close()
    # The run died after step 7; its latest checkpoint is step 5: steps 6, 7 are trained again.
    w = MetricsWriter(tmp_path, resume_step=5)
    assert w.num_dropped == 2
    for s in (6, 7, 8):
        w.log(s, {"reward/mean": 1.0})
    w.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["reward/mean"] for r in recs[5:]] == [1.0, 1.0, 1.0]
