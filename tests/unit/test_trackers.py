"""logging.backends: the mapping from disagg's records to the trackers' calls, the config errors,
and real wandb (offline) and MLflow (SQLite in the run directory) runs read back, without Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from disagg.config import load_config
from disagg.errors import ConfigError
from disagg.metrics import MetricsWriter, read_metrics
from disagg.trackers import flatten, load_state, open_trackers, scalars
from disagg.trackers.mlflow_tracker import params, tracking_uri
from tests.tracker_history import mlflow_history, wandb_config, wandb_history


def test_records_map_to_scalars_under_their_own_names():
    rec = {"reward/mean": 0.5, "samples/trained": 16, "policy_version": 3, "flag": True, "note": "x", "none": None}
    assert scalars(rec) == {"reward/mean": 0.5, "samples/trained": 16.0, "policy_version": 3.0, "flag": 1.0}


def test_config_flattens_to_dotted_keys_and_mlflow_params_are_cut_at_its_limit():
    tree = {"trainer": {"lr": 1e-5, "fsdp": {"reshard": True}}, "data": {"train_files": ["a", "b"]}, "resume": None,
            "cluster": {"trainer_resources": {}}}
    assert flatten(tree) == {"trainer.lr": 1e-5, "trainer.fsdp.reshard": True, "data.train_files": ["a", "b"],
                             "resume": None, "cluster.trainer_resources": {}}
    p = params({"a": {"long": "x" * 50}, "b": 1}, max_len=10)
    assert p == {"a.long": "x" * 10, "b": "1"}
    assert len(params(load_config({}).to_dict(), 6000)) > 100  # the whole config, key by key


def test_mlflow_defaults_to_a_store_in_the_run_directory_unless_told(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(None, tmp_path) == (f"sqlite:///{tmp_path.resolve()}/mlflow.db", True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking_uri(None, tmp_path) == ("http://mlflow:5000", False)
    assert tracking_uri("file:///x", tmp_path) == ("file:///x", False)


@pytest.mark.parametrize("backends, needle", [
    (["jsonl", "wandbb"], "logging.backends=['jsonl', 'wandbb']: unknown backend 'wandbb'"),
    (["prometheus"], "unknown backend 'prometheus' (known: jsonl, tensorboard, wandb, mlflow)"),
])
def test_an_unknown_backend_names_the_key_and_the_value(backends, needle):
    with pytest.raises(ConfigError) as e:
        load_config({"logging": {"backends": backends}})
    assert needle in str(e.value)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_tracker_package_says_which_extra_to_install(name, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    with pytest.raises(ConfigError, match=rf"'{name}' needs the {name} package.*pip install 'disagg\[{name}\]'"):
        load_config({"logging": {"backends": ["jsonl", name]}})
    load_config({"logging": {"backends": ["jsonl", name]}}, mode="generate")  # generate logs no metrics


def test_the_old_tensorboard_key_names_the_new_one():
    with pytest.raises(ConfigError, match=r"logging.tensorboard was replaced by logging.backends"):
        load_config({"logging": {"tensorboard": False}})


def test_a_single_backend_name_is_a_list_and_the_default_is_jsonl_and_tensorboard():
    assert load_config({}).logging.backends == ("jsonl", "tensorboard")
    assert load_config({"logging": {"backends": "jsonl"}}).logging.backends == ("jsonl",)


class _Fake:
    def __init__(self, name, replaces_steps):
        self.name, self.replaces_steps, self.logged, self.closed = name, replaces_steps, [], None

    def log(self, step, metrics):
        self.logged.append((step, metrics))

    def close(self, failed):
        self.closed = failed


def test_every_tracker_gets_the_jsonl_names_and_steps_and_a_resume_sends_each_step_once(tmp_path):
    a, b = _Fake("tb", True), _Fake("wandb", False)
    w = MetricsWriter(tmp_path, [a, b])
    for s in range(1, 8):
        w.log(s, {"reward/mean": s / 10, "policy_version": s + 1, "note": "x"})
    w.close()
    assert [s for s, _ in a.logged] == [s for s, _ in b.logged] == [r["step"] for r in read_metrics(w.path)]
    assert b.logged[0][1] == {"reward/mean": 0.1, "policy_version": 2.0}
    assert (a.closed, b.closed) == (False, False)
    # The run died after step 7, its checkpoint is step 5: steps 6, 7 run again. TensorBoard replaces
    # them; a tracker that cannot keeps its values and gets step 8 on.
    a, b = _Fake("tb", True), _Fake("wandb", False)
    w = MetricsWriter(tmp_path, [a, b], resume_step=5)
    for s in (6, 7, 8):
        w.log(s, {"reward/mean": 1.0})
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("the run failed")
        finally:
            w.close()
    assert [s for s, _ in a.logged] == [6, 7, 8] and [s for s, _ in b.logged] == [8]
    assert (a.closed, b.closed) == (True, True)  # closed while an exception propagated: a failed run


def test_a_tracker_that_fails_is_left_out_and_the_run_and_the_other_trackers_go_on(tmp_path):
    class _Down(_Fake):
        def log(self, step, metrics):
            if step == 2:
                raise ConnectionError("tracker server unreachable")
            super().log(step, metrics)

    down, ok = _Down("wandb", False), _Fake("mlflow", False)
    w = MetricsWriter(tmp_path, [down, ok])
    for s in (1, 2, 3):
        w.log(s, {"reward/mean": s / 10})
    w.close()
    assert [s for s, _ in down.logged] == [1] and [s for s, _ in ok.logged] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(w.path)] == [1, 2, 3] and w.failed_trackers == ["wandb"]
    assert down.closed is True and ok.closed is False  # the failed one's run ends as failed, at once


def _cfg(tmp_path, **logging):
    return load_config({"logging": {"backends": ["jsonl", "tensorboard", "wandb", "mlflow"], "wandb_mode": "offline",
                                    **logging}})


def test_wandb_and_mlflow_runs_hold_each_step_and_a_resume_continues_the_same_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "wandb-dir").mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = _cfg(tmp_path)
    w = MetricsWriter(run_dir, open_trackers(cfg, run_dir, None))
    for s in (1, 2, 3):
        w.log(s, {"reward/mean": s / 10, "timing/step_s": 1.5})
    w.close()
    first = load_state(run_dir)
    w = MetricsWriter(run_dir, open_trackers(cfg, run_dir, 3), resume_step=3)
    for s in (4, 5):
        w.log(s, {"reward/mean": s / 10, "timing/step_s": 1.5})
    w.close()
    state = load_state(run_dir)
    assert state == first  # the same tracker runs

    wb = wandb_history(tmp_path / "wandb-dir", state["wandb"]["run_id"])
    assert {s: h["reward/mean"] for s, h in wb.items()} == {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 5: 0.5}
    assert wb[2] == {"reward/mean": 0.2, "timing/step_s": 1.5}
    conf = wandb_config(tmp_path / "wandb-dir", state["wandb"]["run_id"])
    assert conf["run_dir"] == str(run_dir) and conf["trainer"]["lr"] == cfg.trainer.lr

    uri, run_id = state["mlflow"]["tracking_uri"], state["mlflow"]["run_id"]
    assert uri == f"sqlite:///{run_dir.resolve()}/mlflow.db"
    assert mlflow_history(uri, run_id, "reward/mean") == {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 5: 0.5}
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["disagg.run_dir"] == str(run_dir)
    assert run.data.params["trainer.lr"] == str(cfg.trainer.lr) and run.data.params["run_dir"] == str(run_dir)
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.json", "config-resume-step3.json"}
    assert run.info.artifact_uri.startswith((run_dir / "mlflow-artifacts").resolve().as_uri())
    saved = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text())
    assert saved["logging"]["backends"] == ["jsonl", "tensorboard", "wandb", "mlflow"]
