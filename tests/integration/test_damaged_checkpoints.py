"""A damaged checkpoint as an operator meets it (subprocesses: real Ray, vLLM, gloo): a run
checkpoints after steps 2 and 4, the newest is then damaged on disk, and `disagg train resume=<run>`
goes back to step 2, says so in one WARNING line and trains on; with every checkpoint damaged it
exits 2 before Ray starts, naming each checkpoint and what is wrong with it, never a traceback."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from disagg.digests import MANIFEST, parse_manifest
from disagg.resume import verify_checkpoint
from tests.conftest import SMALL_CLI, disagg_process


def _train(args, run_dir, model_cache, timeout_s=900):
    proc = disagg_process(["train", *SMALL_CLI, *args, f"model.cache_dir={model_cache}", f"hydra.run.dir={run_dir}"])
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, model_cache):
    """Steps 1-4, a checkpoint after step 2 and after step 4, both kept."""
    run_dir = tmp_path_factory.mktemp("damaged") / "run"
    rc, _, err = _train(["trainer.total_steps=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=2"],
                        run_dir, model_cache)
    assert rc == 0, err[-4000:]
    return run_dir


def test_the_writer_records_every_file_of_a_checkpoint_in_its_manifest(first_run):
    for step in (2, 4):
        ckpt = first_run / "checkpoints" / f"step_{step:06d}"
        recorded = parse_manifest((ckpt / MANIFEST).read_text())
        on_disk = {p.name for p in ckpt.iterdir() if p.name != MANIFEST}
        assert set(recorded) == on_disk
        assert {"model.safetensors", "optimizer.pt", "rng_rank0.pt", "state.json", "config.json"} <= on_disk
        assert any(n.startswith("tokenizer") for n in on_disk)
        assert all(recorded[n].num_bytes == (ckpt / n).stat().st_size for n in recorded)
        verdict = verify_checkpoint(str(ckpt))
        assert verdict.verified and verdict.faults == ()


def test_with_every_checkpoint_damaged_resume_exits_2_naming_each_before_ray(first_run, model_cache, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(first_run, run)
    (run / "checkpoints" / "step_000002" / "optimizer.pt").unlink()
    model = run / "checkpoints" / "step_000004" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    model.write_bytes(bytes(data))
    t0 = time.monotonic()
    rc, out, err = _train([f"resume={run}", "trainer.total_steps=6"], run, model_cache, timeout_s=300)
    took = time.monotonic() - t0
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out
    assert "step_000004 (model.safetensors: digest differs" in err
    assert "step_000002 (optimizer.pt: missing)" in err
    assert took < 60, f"{took:.0f}s: a damaged resume must stop before Ray and the engines start"


def test_a_truncated_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(first_run, model_cache):
    model = first_run / "checkpoints" / "step_000004" / "model.safetensors"
    size = model.stat().st_size
    with open(model, "r+b") as f:  # an interrupted copy: the SafetensorError
        f.truncate(size // 3)
    rc, out, err = _train([f"resume={first_run}", "trainer.total_steps=5", "trainer.checkpoint_every=2",
                           "trainer.keep_checkpoints=2"], first_run, model_cache)
    assert rc == 0, err[-4000:]
    warnings = [line for line in (out + err).splitlines() if "WARNING" in line and "damaged checkpoint" in line]
    assert len(warnings) == 1, err[-4000:]
    assert f"step_000004 (model.safetensors: short, {size // 3} of {size} bytes)" in warnings[0]
    assert "resuming from step_000002" in warnings[0]
    assert "resuming the run in" in out + err and "step_000002 (step 2, policy version 3)" in out + err
    names = sorted(p.name for p in (first_run / "checkpoints").iterdir())
    # the one resumed from (never pruned by the run that resumed from it), step 4 written again, the last,
    # and the damaged one, kept for a look
    assert len(names) == 4 and names[2].startswith("step_000004.damaged-"), names
    assert [names[0], names[1], names[3]] == ["step_000002", "step_000004", "step_000005"], names
    for name in ("step_000004", "step_000005"):
        assert verify_checkpoint(str(first_run / "checkpoints" / name)).faults == ()
    steps = [json.loads(x)["step"] for x in (first_run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-3:] == [3, 4, 5], steps  # steps 3 and 4 trained again from the step-2 checkpoint
