"""`disagg train` as a user runs it (a subprocess), and `disagg ctl status`
against that run's live coordinator over real gRPC."""

from __future__ import annotations

import io
import json
import re
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from disagg.metrics import REQUIRED_KEYS
from tests.conftest import SMALL_CLI, disagg_process

REPO = Path(__file__).resolve().parents[2]

SMALL_ARGS = ["trainer.total_steps=3", *SMALL_CLI]


def _ctl(argv) -> tuple[int, str]:
    from disagg.control.ctl import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def user_run(tmp_path_factory, model_cache):
    """`disagg train` for three steps on a user's own model directory, JSONL data (one malformed
    row) and reward function by import path, with `disagg ctl status` polled while it runs: one run
    serves the CLI's and the user-input tests (each `disagg train` costs a Ray start and an engine)."""
    from disagg.model.warmstart import prepare_model
    from tests.conftest import small_config

    tmp = tmp_path_factory.mktemp("cli")
    model_dir = prepare_model(small_config(model_cache))
    common = [f"model.path={model_dir}", f"data.train_files=[{_user_data(tmp)}]", "data.prompt_key=question",
              "reward.name=null", "reward.path=disagg.tasks.reverse:reverse_digits_reward"]
    root = tmp / "runs"
    run_dir = root / "cli-run"
    proc = disagg_process(["train", *SMALL_ARGS, *common, f"logging.root_dir={root}", f"hydra.run.dir={run_dir}"])
    addr_file = run_dir / "coordinator.addr"
    seen_status = None
    table = ""
    deadline = time.monotonic() + 600
    # Poll the live coordinator until the first committed version shows up.
    while proc.poll() is None and time.monotonic() < deadline:
        if addr_file.exists():
            addr = addr_file.read_text().strip()
            rc, out = _ctl(["status", "--run-dir", str(run_dir), "--json", "--timeout", "2"])
            if rc == 0:
                st = json.loads(out)
                if st["committed_version"] >= 1 and st["engines"]:
                    seen_status = st
                    table = _ctl(["status", "--address", addr, "--token-file", str(run_dir / "control.token")])[1]
                    break
        time.sleep(0.05)
    out, err = proc.communicate(timeout=600)
    return {"proc": proc, "out": out, "err": err, "run_dir": run_dir, "status": seen_status, "table": table,
            "model_dir": model_dir, "common": common, "tmp": tmp}


def test_train_three_steps_writes_metrics_and_ctl_sees_the_live_run(user_run):
    proc, out, err, run_dir = user_run["proc"], user_run["out"], user_run["err"], user_run["run_dir"]
    seen_status, table = user_run["status"], user_run["table"]
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
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, missing
        assert r["weight_sync/bytes"] > 0 and r["samples/trained"] > 0
    assert [r["policy_version"] for r in recs] == [2, 3, 4]
    assert (run_dir / "reward.png").stat().st_size > 0
    assert any((run_dir / "tensorboard").iterdir())
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["trainer"]["total_steps"] == 3
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


def test_user_model_data_and_reward_path_train_and_generate(user_run):
    assert user_run["proc"].returncode == 0, user_run["err"][-3000:]
    model_dir, common, tmp_path = user_run["model_dir"], user_run["common"], user_run["tmp"]
    recs = [json.loads(x) for x in (user_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and all(r["data/skipped_rows"] == 1 for r in recs)
    assert all(r["samples/trained"] > 0 for r in recs)

    # Standalone engines on the real weights: greedy (temperature 0, allowed in generate), every
    # sample is the checkpoint's greedy answer, exactly as HF computes it from the same directory.
    gen_dir = tmp_path / "gen-run"
    proc = disagg_process(["generate", *SMALL_ARGS, *common, "rollout.temperature=0", f"hydra.run.dir={gen_dir}"])
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
