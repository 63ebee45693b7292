"""`disagg train` as a user runs it (a subprocess: real Ray, vLLM, gloo) on a user's own model
directory, JSONL data (one malformed row) and reward function by import path, operated while it
runs: `disagg ctl status` against its live coordinator over real gRPC; the Ops gRPC service (token,
watch, pause/resume, set-staleness, checkpoint, graceful stop); its Prometheus endpoints (the
coordinator's and each engine's vLLM /metrics). Then what the stopped run left (metrics, plots,
exit status, console), and `disagg generate` on the same model.

One `disagg train` process serves all of that (each costs a Ray start, an engine and a trainer):
the operating tests run first and end it with Stop; the run's own checks read what it left."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import threading
import time
import urllib.request
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.control.auth import read_token
from disagg.control.client import ControlRpcError, CoordinatorClient
from disagg.metrics import REQUIRED_KEYS
from tests.conftest import SMALL_CLI, disagg_process

REPO = Path(__file__).resolve().parents[2]

TOTAL_STEPS = 2000  # far more steps than the tests let it run: it ends on Stop
SMALL_ARGS = [f"trainer.total_steps={TOTAL_STEPS}", *SMALL_CLI]
BATCH_GROUPS = 4  # algorithm.prompts_per_step in SMALL_CLI


def _ctl(argv) -> tuple[int, str]:
    from disagg.control.ctl import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def _wait(cond, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) while waiting for {what}: "
                                 f"{proc.stderr.read()[-3000:]}")
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class LiveRun:
    """The module's `disagg train` process and what the tests saw of it. ``output`` waits for the
    process to end (the operating test's Stop, else a Stop of its own) and keeps its output."""

    def __init__(self, proc, run_dir: Path, client: CoordinatorClient, status: dict, table: str, **user) -> None:
        self.proc, self.run_dir, self.client, self.status, self.table = proc, run_dir, client, status, table
        self.user = user  # model_dir, common (the user's overrides), tmp
        self._output: tuple[str, str] | None = None

    def output(self) -> tuple[str, str]:
        if self._output is None:
            if self.proc.poll() is None:
                try:  # a no-op where the operating test's Stop came first
                    self.client.stop("the module's checks")
                except ControlRpcError:
                    pass
            self._output = self.proc.communicate(timeout=300)
        return self._output


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, model_cache):
    from disagg.model.warmstart import prepare_model
    from tests.conftest import small_config

    tmp = tmp_path_factory.mktemp("cli")
    model_dir = prepare_model(small_config(model_cache))
    common = [f"model.path={model_dir}", f"data.train_files=[{_user_data(tmp)}]", "data.prompt_key=question",
              "reward.name=null", "reward.path=disagg.tasks.reverse:reverse_digits_reward"]
    root = tmp / "runs"
    run_dir = root / "cli-run"
    proc = disagg_process(["train", *SMALL_ARGS, *common, f"logging.root_dir={root}", f"hydra.run.dir={run_dir}"])
    try:
        _wait(lambda: (run_dir / "coordinator.addr").exists() and (run_dir / "control.token").exists(), 300,
              "the coordinator's address and token", proc)
        addr = (run_dir / "coordinator.addr").read_text().strip()

        def committed():  # `disagg ctl status` polled until the first committed version shows up
            rc, out = _ctl(["status", "--run-dir", str(run_dir), "--json", "--timeout", "2"])
            st = json.loads(out) if rc == 0 else None
            return st if st and st["committed_version"] >= 1 and st["engines"] else None

        seen_status = _wait(committed, 600, "a committed version through `disagg ctl status`", proc)
        table = _ctl(["status", "--address", addr, "--token-file", str(run_dir / "control.token")])[1]
        client = CoordinatorClient(addr, timeout_s=10, token=read_token(run_dir / "control.token"))
        _wait(lambda: client.status().trainer_step >= 2, 600, "two trained steps", proc)
        yield LiveRun(proc, run_dir, client, seen_status, table, model_dir=model_dir, common=common, tmp=tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def _scrape(url: str) -> dict[str, float]:
    """{sample name with its labels: value} of one scrape, parsed by prometheus-client."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_endpoints_of_a_live_run(live_run):
    run_dir, proc, client = live_run.run_dir, live_run.proc, live_run.client
    rc, out = _ctl(["status", "--run-dir", str(run_dir), "--json"])
    assert rc == 0
    shown = json.loads(out)
    url = shown["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    rc, out = _ctl(["status", "--run-dir", str(run_dir)])
    assert rc == 0 and url in out

    def agreeing():  # a scrape, the status, a scrape: the same versions and engine states when no step
        # finished and no sync began or ended between them (a sync flips an engine READY <-> SYNCING)
        before, st, after = _scrape(url), client.status(), _scrape(url)
        keys = [("disagg_trainer_policy_version", st.trainer_version), ("disagg_trainer_step", st.trainer_step),
                ("disagg_committed_policy_version", st.committed_version),
                *[(f"disagg_engine_state,disagg_engine_state={e.state.value},engine_id={e.engine_id}", 1)
                  for e in st.engines]]
        if all(before.get(k) == v == after.get(k) for k, v in keys):
            return after, st

    first, st = _wait(agreeing, 60, "a scrape that agrees with the status", proc)
    assert first["disagg_max_staleness"] == st.max_staleness
    _wait(lambda: client.status().trainer_step >= st.trainer_step + 2, 120, "two more steps", proc)
    second, st2 = _wait(agreeing, 60, "a scrape that agrees with the status", proc)
    assert second["disagg_trainer_policy_version"] > first["disagg_trainer_policy_version"]
    assert second["disagg_committed_policy_version"] >= first["disagg_trainer_policy_version"]
    assert second["disagg_weight_sync_seconds_count"] > first["disagg_weight_sync_seconds_count"] >= 1
    assert second["disagg_weight_sync_seconds_sum"] > 0
    assert second["disagg_staleness_max_seen"] <= second["disagg_max_staleness"]
    for must_be_zero in ("disagg_dummy_served_groups_total", "disagg_trained_beyond_staleness_samples_total",
                         "disagg_prompts_lost", "disagg_engine_deaths_total"):
        assert second[must_be_zero] == 0, must_be_zero
    engine_ids = [e.engine_id for e in st2.engines]
    assert sum(second[f"disagg_engine_tokens_per_second,engine_id={i}"] for i in engine_ids) > 0
    for e in st2.engines:
        assert second[f"disagg_engine_state,disagg_engine_state={e.state.value},engine_id={e.engine_id}"] == 1

    # Each engine's own vLLM /metrics, at the address ctl status lists: vLLM's engine metrics, counting tokens.
    for e in shown["engines"]:
        assert e["vllm_metrics_url"] == e["address"] + "/metrics"
        vllm = _scrape(e["vllm_metrics_url"])
        generated = [v for k, v in vllm.items() if k.startswith("vllm:generation_tokens_total")]
        assert generated and sum(generated) > 0, sorted(k for k in vllm if k.startswith("vllm:"))[:20]


def test_operating_a_live_run(live_run):
    run_dir, proc, client = live_run.run_dir, live_run.proc, live_run.client
    assert stat.S_IMODE(os.stat(run_dir / "control.token").st_mode) == 0o600
    anonymous = CoordinatorClient(client.address, timeout_s=5)
    with pytest.raises(ControlRpcError) as e:
        anonymous.status()
    assert e.value.code == "UNAUTHENTICATED"

    # watch: steps stream in as they finish.
    watched: list[tuple[int, dict]] = []
    watcher = threading.Thread(target=lambda: watched.extend(client.watch_metrics(from_step=1)), daemon=True)
    watcher.start()
    st = client.status()
    assert st.phase == "running" and st.total_steps == TOTAL_STEPS and st.engines[0].address.startswith("http")

    # pause: in-flight groups finish, then nothing new starts and training stops for want of samples
    # (a buffered batch may still train first). Once the driver has acted on the pause (its event;
    # what the status shows from then on comes after its last wave): nothing generating, no batch
    # left in the buffer, no step training or syncing.
    client.pause_rollout("test")

    def stopped() -> bool:
        s = client.status()
        return (any(e.kind == "rollout_paused" for e in s.events) and s.inflight_groups == 0
                and s.training_groups == 0 and s.buffer_groups < BATCH_GROUPS)

    _wait(stopped, 120, "the rollout to drain and training to stop", proc)
    step_paused = client.status().trainer_step
    time.sleep(3.0)
    st = client.status()
    assert st.trainer_step == step_paused and st.inflight_groups == 0, "trained or generated while paused"
    with pytest.raises(ControlRpcError) as e:
        client.pause_rollout()
    assert e.value.code == "FAILED_PRECONDITION"

    client.resume_rollout()
    _wait(lambda: client.status().trainer_step >= step_paused + 2, 120, "steps after resume", proc)
    assert client.set_max_staleness(2) == 2 and client.status().max_staleness == 2
    with pytest.raises(ControlRpcError) as e:
        client.set_max_staleness(-5)
    assert e.value.code == "INVALID_ARGUMENT"

    # checkpoint: returns once on disk; HF loads it.
    step, version, path = client.checkpoint(timeout_s=120)
    assert step > step_paused and version == step + 1
    saved = json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "state.json").read_text())
    assert saved["step"] == step and saved["policy_version"] == version and saved["data_cursor"] > 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)
    import torch

    opt = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False)
    assert opt["scheduler"]["last_epoch"] == step and opt["optimizer"]["state"]

    # stop: the step in progress finishes, a final checkpoint, exit 0.
    assert "stopping" in client.stop("end of test")
    out, err = live_run.output()
    assert proc.returncode == 0, err[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = recs[-1]["step"]
    assert last < TOTAL_STEPS and [r["step"] for r in recs] == list(range(1, last + 1))
    final = json.loads((run_dir / "checkpoints" / f"step_{last:06d}" / "state.json").read_text())
    assert final["step"] == last and final["policy_version"] == recs[-1]["policy_version"]
    assert "stopped on request (end of test)" in out + err
    watcher.join(timeout=30)
    assert not watcher.is_alive(), "the metrics stream did not end with the run"
    assert [s for s, _ in watched] == list(range(1, last + 1))
    assert watched[-1][1]["reward/mean"] == pytest.approx(recs[-1]["reward/mean"])


def test_train_writes_metrics_and_ctl_sees_the_live_run(live_run):
    out, err = live_run.output()
    proc, run_dir, seen_status, table = live_run.proc, live_run.run_dir, live_run.status, live_run.table
    assert proc.returncode == 0, err[-3000:]
    assert seen_status is not None, "never saw a committed version through `disagg ctl status`"
    assert [e["engine_id"] for e in seen_status["engines"]] == [0]
    assert seen_status["engines"][0]["policy_version"] >= 1
    assert "READY" in table or "SYNCING" in table
    assert "committed" in table.lower()

    # The last line printed is the run directory, and nothing follows it on stderr: no teardown
    # noise from extension modules (Triton's nanobind reported ~500 "leaked function" lines).
    assert out.strip().splitlines()[-1] == f"run directory: {run_dir.resolve()}"
    assert "nanobind" not in err and "leaked" not in err, err[-2000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = recs[-1]["step"]
    assert last >= 3 and [r["step"] for r in recs] == list(range(1, last + 1))
    for r in recs:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, missing
        assert r["weight_sync/bytes"] > 0 and r["samples/trained"] > 0
    assert [r["policy_version"] for r in recs] == list(range(2, last + 2))
    assert (run_dir / "reward.png").stat().st_size > 0
    assert any((run_dir / "tensorboard").iterdir())
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["trainer"]["total_steps"] == TOTAL_STEPS
    assert (run_dir / ".hydra" / "config.yaml").exists()


@pytest.mark.parametrize("bad", ["trainer.num_workers=0", "transport.dtype=float7", "reward.name=nonsense"])
def test_invalid_config_fails_before_any_actor_starts(tmp_path, bad):
    t0 = time.monotonic()
    proc = disagg_process(["train", bad, f"logging.root_dir={tmp_path}"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-2000:]
    key, value = bad.split("=")
    assert re.search(rf"{re.escape(key)}='?{re.escape(value)}", err), err[-2000:]
    assert "Ray" not in out + err.replace(bad, "") and "coordinator" not in out + err, (out + err)[-2000:]
    assert time.monotonic() - t0 < 60


def _from_a_ray_package(tmp_path: Path, args: list[str], env: dict[str, str]) -> tuple[int, str, Path]:
    """`disagg train ARGS` started where a `ray job submit --working-dir` driver starts: in the
    session's unpacked package. trainer.num_workers=0 ends it at validation, after hydra made the
    run directory. Returns (exit status, stderr, the package)."""
    pkg = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0a1b2c"
    pkg.mkdir(parents=True)
    proc = disagg_process(["train", "trainer.num_workers=0", *args], cwd=pkg,
                          env={"PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), **env})
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, pkg


def test_a_driver_in_a_ray_package_puts_its_run_in_home_and_never_in_the_package(tmp_path):
    rc, err, pkg = _from_a_ray_package(tmp_path, [], {"DISAGG_RUNS_DIR": ""})
    assert rc == 2 and "trainer.num_workers=0" in err  # it got past the run directory
    (run_dir,) = (tmp_path / "home" / "disagg-runs").iterdir()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert list(pkg.iterdir()) == []
    # $DISAGG_RUNS_DIR, when set, is the root instead.
    rc, err, pkg = _from_a_ray_package(tmp_path / "env", [], {"DISAGG_RUNS_DIR": str(tmp_path / "mine")})
    assert rc == 2 and len(list((tmp_path / "mine").iterdir())) == 1 and list(pkg.iterdir()) == []


@pytest.mark.parametrize("args, env, key", [
    (["logging.root_dir=runs"], {}, "logging.root_dir='runs'"),
    ([], {"DISAGG_RUNS_DIR": "runs"}, "DISAGG_RUNS_DIR='runs'"),
    (["hydra.run.dir=runs/x"], {}, "hydra.run.dir='runs/x'"),
    (["run_dir=runs/x"], {}, "run_dir='runs/x'"),
])
def test_a_run_directory_inside_a_ray_package_is_refused_before_anything_is_written(tmp_path, args, env, key):
    rc, err, pkg = _from_a_ray_package(tmp_path, args, {"DISAGG_RUNS_DIR": "", **env})
    assert rc == 2
    assert f"disagg: invalid config: {key} resolves to {pkg / 'runs'}" in err
    assert f"Set {key.split('=')[0]} to an absolute path outside it" in err
    assert "Traceback" not in err
    assert list(pkg.iterdir()) == []


def test_ctl_without_address_is_a_usage_error(monkeypatch):
    monkeypatch.delenv("DISAGG_COORDINATOR", raising=False)
    monkeypatch.delenv("DISAGG_RUN_DIR", raising=False)
    rc, _ = _ctl(["status"])
    assert rc == 2


def _user_data(tmp_path: Path) -> Path:
    """A JSONL task file as a user would bring it, with one malformed row."""
    from disagg.tasks.reverse import ReverseDigitsSource

    it = iter(ReverseDigitsSource(4, seed=11))
    lines = [json.dumps({"question": r.prompt, "answer": r.row["answer"]}) for r in (next(it) for _ in range(12))]
    lines.insert(3, "{not json")
    p = tmp_path / "train.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_user_model_data_and_reward_path_train_and_generate(live_run):
    _, err = live_run.output()
    assert live_run.proc.returncode == 0, err[-3000:]
    model_dir, common, tmp_path = live_run.user["model_dir"], live_run.user["common"], live_run.user["tmp"]
    recs = [json.loads(x) for x in (live_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) >= 3 and all(r["data/skipped_rows"] == 1 for r in recs)
    assert all(r["samples/trained"] > 0 for r in recs)

    # Standalone engines on the real weights: greedy (temperature 0, allowed in generate), every
    # sample is the checkpoint's greedy answer, exactly as HF computes it from the same directory.
    gen_dir = tmp_path / "gen-run"
    proc = disagg_process(["generate", *SMALL_CLI, *common, "rollout.temperature=0", f"hydra.run.dir={gen_dir}"])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(x) for x in (gen_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # prompts_per_step, one greedy sample each
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["samples"] == 4

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    for row in rows:
        # Teacher-force the engine's tokens through HF: each must be the arg-max of HF's
        # logits from the same checkpoint (up to float noise between the two kernels).
        prompt = [tok.bos_token_id] + tok.encode(row["prompt"], add_special_tokens=False)
        ids = torch.tensor([prompt + row["response_ids"]])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(row["response_ids"])[:, None])[:, 0]
        assert torch.all(chosen >= logits.max(dim=1).values - 1e-4), row
        assert row["response_ids"][-1] == tok.eos_token_id or len(row["response_ids"]) == 8, row
