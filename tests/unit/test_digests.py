"""Checkpoints that verify themselves, without Ray: file digests (chunked, threaded), the faults a
damaged copy reports, a download checked against its manifest, and which checkpoint a resume takes
when the newest is damaged (the checkpoints here are written with the manifest code the trainer's
writer uses; tests/integration/test_damaged_checkpoints.py damages the real writer's)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from disagg import digests, storage
from disagg.digests import MANIFEST, FileDigest, compare, digest_bytes, digest_files, manifest_text, parse_manifest
from disagg.errors import CheckpointDamaged, ConfigError
from disagg.resume import find_checkpoint, newest_verified, verify_checkpoint


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1000 bytes read 300 at a time: a few KB exercise every boundary."""
    monkeypatch.setattr(digests, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(digests, "READ_BYTES", 300)


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 3500])
def test_a_files_digest_is_its_bytes_digest_on_any_number_of_threads(tmp_path, small_chunks, size):
    data = os.urandom(size)
    (tmp_path / "f.bin").write_bytes(data)
    one = digest_files(tmp_path, ["f.bin"], num_threads=1)["f.bin"]
    four = digest_files(tmp_path, ["f.bin"], num_threads=4)["f.bin"]
    assert one == four == digest_bytes(data)
    assert one.num_bytes == size
    if size:
        changed = bytearray(data)
        changed[-1] ^= 1  # the last chunk's last byte
        assert digest_bytes(bytes(changed)).digest != one.digest


def _write_checkpoint(root: Path, files: dict[str, bytes], step: int = 2, manifest: bool = True) -> Path:
    """A checkpoint directory holding ``files`` and state.json, with its manifest written last."""
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    state = {"step": step, "policy_version": step + 1, "data_cursor": 4 * step}
    if manifest:
        state["manifest"] = MANIFEST
    (root / "state.json").write_text(json.dumps(state))
    if manifest:
        (root / MANIFEST).write_text(manifest_text(digest_files(root, digests.files_under(root))))
    return root


FILES = {"model.safetensors": os.urandom(5000), "optimizer.pt": os.urandom(3000), "rng_rank0.pt": b"rng",
         "tokenizer.json": b"{}"}


def _damage(root: Path, how: str) -> str:
    """Damage one file of a checkpoint as a copy gone wrong leaves it; returns the fault expected."""
    if how == "truncated":
        (root / "model.safetensors").write_bytes(FILES["model.safetensors"][:1200])
        return "model.safetensors: short, 1200 of 5000 bytes"
    if how == "bytes_changed":
        data = bytearray(FILES["optimizer.pt"])
        data[1500] ^= 0xFF
        (root / "optimizer.pt").write_bytes(bytes(data))
        return "optimizer.pt: digest differs (its bytes changed)"
    if how == "deleted":
        (root / "rng_rank0.pt").unlink()
        return "rng_rank0.pt: missing"
    if how == "grown":
        (root / "tokenizer.json").write_bytes(b"{}\n")
        return "tokenizer.json: 3 bytes where 2 were written"
    if how == "manifest_differs":  # a manifest of another checkpoint's files
        doc = json.loads((root / MANIFEST).read_text())
        doc["files"]["optimizer.pt"]["digest"] = "0" * 32
        (root / MANIFEST).write_text(json.dumps(doc))
        return "optimizer.pt: digest differs (its bytes changed)"
    if how == "manifest_garbled":
        (root / MANIFEST).write_text('{"format": 1, "files": ')
        return f"{MANIFEST}: not a manifest"
    if how == "manifest_missing":
        (root / MANIFEST).unlink()
        return f"{MANIFEST}: missing (its writer did not finish)"
    raise ValueError(how)


DAMAGES = ["truncated", "bytes_changed", "deleted", "grown", "manifest_differs", "manifest_garbled",
           "manifest_missing"]


@pytest.mark.parametrize("how", DAMAGES)
def test_each_kind_of_damage_is_named_with_its_file(tmp_path, small_chunks, how):
    ckpt = _write_checkpoint(tmp_path / "step_000002", FILES)
    assert verify_checkpoint(str(ckpt)).faults == ()
    assert verify_checkpoint(str(ckpt)).verified
    fault = _damage(ckpt, how)
    got = verify_checkpoint(str(ckpt))
    assert len(got.faults) == 1 and got.faults[0].startswith(fault), got.faults


def test_compare_reports_every_damaged_file_and_nothing_else(tmp_path, small_chunks):
    ckpt = _write_checkpoint(tmp_path / "c", FILES)
    expected = parse_manifest((ckpt / MANIFEST).read_text())
    assert set(expected) == {*FILES, "state.json"}
    faults = [_damage(ckpt, h) for h in ("truncated", "bytes_changed", "deleted")]
    assert compare(ckpt, expected) == sorted(faults)


def _run_dir(tmp_path: Path, steps_damaged: dict[int, str | None]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"trainer": {"checkpoint_dir": None}}))
    for step, how in steps_damaged.items():
        ckpt = _write_checkpoint(run / "checkpoints" / f"step_{step:06d}", FILES, step)
        if how:
            _damage(ckpt, how)
    return run


@pytest.mark.parametrize("how", DAMAGES)
def test_a_resume_skips_the_damaged_newest_checkpoint_says_why_and_moves_it_aside(tmp_path, caplog, how):
    run = _run_dir(tmp_path, {2: None, 4: how})
    with caplog.at_level(logging.WARNING, logger="disagg.resume"):
        picked = find_checkpoint(str(run))
    assert picked == str(run / "checkpoints" / "step_000002")
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[0] == "step_000002" and names[1].startswith("step_000004.damaged-") and len(names) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "step_000004" in warnings[0]
    assert "resuming from step_000002" in warnings[0]
    expected_file = {"truncated": "model.safetensors", "bytes_changed": "optimizer.pt", "deleted": "rng_rank0.pt",
                     "grown": "tokenizer.json", "manifest_differs": "optimizer.pt"}.get(how, MANIFEST)
    assert expected_file in warnings[0]


def test_with_no_checkpoint_that_verifies_the_error_names_each_and_its_fault(tmp_path):
    run = _run_dir(tmp_path, {2: "deleted", 4: "truncated"})
    with pytest.raises(ConfigError) as e:
        find_checkpoint(str(run))
    msg = str(e.value)
    assert "no checkpoint in" in msg
    assert "step_000004 (model.safetensors: short, 1200 of 5000 bytes)" in msg
    assert "step_000002 (rng_rank0.pt: missing)" in msg
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]  # nothing moved


def test_a_named_damaged_checkpoint_is_an_error_not_a_silent_switch(tmp_path):
    run = _run_dir(tmp_path, {2: None, 4: "bytes_changed"})
    with pytest.raises(ConfigError, match="the checkpoint is damaged: optimizer.pt: digest differs"):
        find_checkpoint(str(run / "checkpoints" / "step_000004"))
    assert find_checkpoint(str(run / "checkpoints" / "step_000002")) == str(run / "checkpoints" / "step_000002")


def test_a_checkpoint_from_before_manifests_loads_and_says_it_was_not_verified(tmp_path, caplog):
    _write_checkpoint(tmp_path / "ck" / "step_000003", FILES, 3, manifest=False)
    with caplog.at_level(logging.WARNING, logger="disagg.resume"):
        picked = newest_verified("x", [str(tmp_path / "ck" / "step_000003")])
    assert picked.endswith("step_000003")
    assert any("loaded unverified" in r.getMessage() for r in caplog.records)


def test_a_download_is_checked_against_its_manifest(tmp_path, small_chunks):
    remote = _write_checkpoint(tmp_path / "remote" / "step_000002", FILES)
    url = f"file://{remote}"
    copy = storage.local_copy(url, str(tmp_path / "cache-a"))
    assert {p.name for p in copy.iterdir()} == {*FILES, "state.json", MANIFEST}
    fault = _damage(remote, "bytes_changed")
    with pytest.raises(CheckpointDamaged) as e:
        storage.local_copy(url, str(tmp_path / "cache-b"))
    assert e.value.faults == [fault] and url in str(e.value)
    assert not any((tmp_path / "cache-b" / "checkpoints").glob("step_000002*/"))  # no copy left to reuse
    assert verify_checkpoint(url, str(tmp_path / "cache-c")).faults == (fault,)


def test_an_upload_that_lands_short_is_an_error(tmp_path, monkeypatch):
    import fsspec.implementations.local as local_fs

    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 100)
    real = local_fs.LocalFileSystem.put_file

    def short_put(self, lpath, rpath, **kw):  # an upload cut off after 60 bytes
        real(self, lpath, rpath, **kw)
        with open(rpath, "r+b") as f:
            f.truncate(60)

    monkeypatch.setattr(local_fs.LocalFileSystem, "put_file", short_put)
    with pytest.raises(OSError, match="60 bytes arrived of 100"):
        storage.put_file(src, f"file://{tmp_path}/up/f.bin")


def test_a_manifest_of_another_format_is_refused_by_name():
    text = json.dumps({"format": 9, "algorithm": "sha256", "chunk_bytes": 1, "files": {}})
    with pytest.raises(digests.ManifestError, match="format 9, 'sha256'"):
        parse_manifest(text)
    assert parse_manifest(manifest_text({"a": FileDigest(3, "ab")})) == {"a": FileDigest(3, "ab")}
