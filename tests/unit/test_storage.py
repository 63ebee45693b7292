"""Checkpoint locations through fsspec, on its in-process memory filesystem and on file:// URLs:
a writer's local directory copied up, a reader's copy made once per node and made again when the
checkpoint at that URL is written anew."""

from __future__ import annotations

import uuid

import pytest

from disagg import storage


@pytest.fixture
def url():
    where = f"memory://store-{uuid.uuid4().hex[:8]}/step_000003"
    yield where
    storage.remove(where.rsplit("/", 1)[0])


def _files(location: str) -> dict[str, str]:
    fs, root = storage._fs(location)
    return {f[len(root) + 1:]: fs.cat_file(f).decode() for f in fs.find(root)}


def test_a_writable_dir_at_a_url_is_copied_up_when_the_block_ends(url):
    with storage.writable_dir(url) as out:
        (out / "model.safetensors").write_text("weights")
        (out / "sub").mkdir()
        (out / "sub" / "rng_rank1.pt").write_text("rng")
        assert not storage.exists(url)  # nothing there until the block ends
    assert _files(url) == {"model.safetensors": "weights", "sub/rng_rank1.pt": "rng"}
    assert not out.exists()  # the temporary directory is gone


def test_a_writable_dir_that_fails_copies_nothing_up(url):
    with pytest.raises(RuntimeError), storage.writable_dir(url) as out:
        (out / "optimizer.pt").write_text("half")
        raise RuntimeError("the writer died")
    assert not storage.exists(url)


def test_a_writable_dir_at_a_path_is_that_path(tmp_path):
    with storage.writable_dir(str(tmp_path / "a" / "b")) as out:
        (out / "x").write_text("1")
    assert out == tmp_path / "a" / "b" and (tmp_path / "a" / "b" / "x").read_text() == "1"


def test_local_copy_of_a_url_is_made_once_and_again_for_a_rewritten_checkpoint(url, tmp_path):
    storage.write_text(storage.join(url, "config.json"), "{}")
    storage.write_text(storage.join(url, "state.json"), '{"time_unix_s": 1}')
    first = storage.local_copy(url, str(tmp_path))
    assert first.parent == tmp_path / "checkpoints" and first.name.startswith("step_000003-")
    assert {p.name: p.read_text() for p in first.iterdir()} == {"config.json": "{}", "state.json": '{"time_unix_s": 1}'}
    # Same checkpoint (same state.json): this node's copy, not another download.
    storage.write_text(storage.join(url, "config.json"), '{"changed": true}')
    assert storage.local_copy(url, str(tmp_path)) == first
    assert (first / "config.json").read_text() == "{}"
    # Written anew at that URL (a new state.json): a new copy with the new files.
    storage.write_text(storage.join(url, "state.json"), '{"time_unix_s": 2}')
    second = storage.local_copy(url, str(tmp_path))
    assert second != first and (second / "config.json").read_text() == '{"changed": true}'
    assert not list(tmp_path.glob("checkpoints/*.partial-*"))


def test_local_copy_of_a_path_is_the_path_and_of_nothing_an_error(tmp_path, url):
    assert storage.local_copy(str(tmp_path), "/unused") == tmp_path
    with pytest.raises(FileNotFoundError, match="no files"):
        storage.local_copy(url, str(tmp_path))


def test_file_urls_and_paths_name_the_same_directory(tmp_path):
    storage.write_text(f"file://{tmp_path}/ckpt/step_000001/state.json", "{}")
    assert (tmp_path / "ckpt" / "step_000001" / "state.json").read_text() == "{}"
    assert storage.list_dirs(f"file://{tmp_path}/ckpt") == storage.list_dirs(str(tmp_path / "ckpt")) == ["step_000001"]
    storage.remove(f"file://{tmp_path}/ckpt/step_000001")
    assert storage.list_dirs(str(tmp_path / "ckpt")) == [] and storage.list_dirs(str(tmp_path / "none")) == []
