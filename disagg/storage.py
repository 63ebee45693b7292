"""Checkpoint locations: a plain path or an fsspec URL, written and read the same way.

A multi-node resume reads a checkpoint on other nodes than the one that wrote it, so checkpoints
go where every node can read them (``trainer.checkpoint_dir``):

- a plain path: a directory every node mounts at that path (a shared filesystem); writers write
  their files there directly;
- an fsspec URL (``s3://bucket/ckpt``, ``gs://...``, ``file:///shared/ckpt``, any protocol fsspec
  knows and whose package is installed): each writer fills a local temporary directory and copies it
  up file by file (``writable_dir``); each reader copies a checkpoint down into its node's cache once
  (``local_copy``), because transformers, vLLM and ``torch.load`` read local files.

A checkpoint's ``manifest.json`` (``disagg.digests``) records every file's size and digest: an
upload is checked for size after the copy, a download against the manifest (``CheckpointDamaged``).
``memory://`` lives in one process: unit tests only. This module never imports torch or vLLM.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from disagg.digests import MANIFEST, ManifestError, compare, parse_manifest
from disagg.errors import CheckpointDamaged, ConfigError

CACHE_KEY_FILE = "state.json"
"""Its content is part of a downloaded copy's cache key: a checkpoint written again at the same URL
(a run rewound and trained on) has a new ``state.json`` (its time), so it is fetched again."""


def is_url(location: str) -> bool:
    """Whether ``location`` names a filesystem by protocol (``s3://...``, ``file://...``)."""
    return "://" in location


def normalize(location: str) -> str:
    """A plain path made absolute (``~`` expanded, relative to the cwd); a URL unchanged. Workers in
    other processes have other cwds: every path handed to them must be absolute."""
    return location if is_url(location) else os.path.abspath(os.path.expanduser(location))


def check_location(key: str, location: str) -> None:
    """A ConfigError quoting ``key`` if fsspec cannot open ``location``'s protocol here, or if it is
    ``memory://`` (each process would see its own empty filesystem)."""
    if not is_url(location):
        return
    import fsspec

    protocol = location.split("://", 1)[0]
    if protocol == "memory":
        raise ConfigError(f"{key}={location!r}: memory:// lives in one process, and the trainer workers and "
                          "engines are processes of their own; use a shared path or a URL they all reach")
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError as e:
        raise ConfigError(f"{key}={location!r}: fsspec knows no protocol {protocol!r} ({e})") from None
    except ImportError as e:
        raise ConfigError(f"{key}={location!r}: {e} (on every node)") from None


def _fs(location: str):
    from fsspec.core import url_to_fs

    return url_to_fs(location)


def join(location: str, *names: str) -> str:
    return "/".join([location.rstrip("/"), *names])


def exists(location: str) -> bool:
    fs, path = _fs(location)
    return fs.exists(path)


def list_dirs(location: str) -> list[str]:
    """Names of the subdirectories of ``location`` ([] if it does not exist)."""
    fs, path = _fs(location)
    if not fs.isdir(path):
        return []
    return sorted(posixpath.basename(e["name"].rstrip("/")) for e in fs.ls(path, detail=True)
                  if e["type"] == "directory")


def read_text(location: str) -> str:
    fs, path = _fs(location)
    return fs.cat_file(path).decode()


def write_text(location: str, text: str) -> None:
    fs, path = _fs(location)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, text.encode())


def put_file(local: Path, location: str) -> None:
    """Copy ``local`` to ``location``, checked after the copy: an upload that left fewer or more
    bytes there than ``local`` holds is an OSError naming both (the digests are checked by the
    reader, against the manifest)."""
    fs, path = _fs(location)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.put_file(str(local), path)
    sent, landed = local.stat().st_size, fs.size(path)
    if landed != sent:
        raise OSError(f"copied {local} to {location}: {landed} bytes arrived of {sent}")


def move_aside(location: str, suffix: str) -> str:
    """Rename ``location`` (a directory) to ``<location>.<suffix>`` and return the new name; a URL's
    files are moved one by one (object stores rename nothing)."""
    target = f"{location.rstrip('/')}.{suffix}"
    if not is_url(location):
        os.rename(location, target)
        return target
    fs, path = _fs(location)
    fs.mv(path, _fs(target)[1], recursive=True)
    return target


def remove(location: str) -> None:
    """Delete ``location`` and everything under it; nothing if it does not exist."""
    fs, path = _fs(location)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@contextmanager
def writable_dir(location: str) -> Iterator[Path]:
    """A local directory whose files end up at ``location``: the directory itself for a plain path
    (created); for a URL a temporary directory, copied up file by file when the block ends without
    an error (then deleted either way)."""
    if not is_url(location):
        out = Path(location)
        out.mkdir(parents=True, exist_ok=True)
        yield out
        return
    with tempfile.TemporaryDirectory(prefix="disagg-upload-") as tmp:
        yield Path(tmp)
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                put_file(f, join(location, f.relative_to(tmp).as_posix()))


def local_copy(location: str, cache_dir: str) -> Path:
    """A local directory holding what ``location`` holds: a plain path as it is; a URL copied once
    into ``<cache_dir>/checkpoints/`` on this node and reused. The processes of a node that ask at
    the same time (trainer ranks, engines) wait for one download under a file lock."""
    if not is_url(location):
        return Path(location)
    fs, root = _fs(location)
    files = fs.find(root)
    if not files:
        raise FileNotFoundError(f"{location}: no files there")
    key_file = posixpath.join(root, CACHE_KEY_FILE)
    tag = fs.cat_file(key_file) if key_file in files else b""
    key = hashlib.sha256(location.encode() + b"\0" + tag).hexdigest()[:16]
    dest = Path(os.path.expanduser(cache_dir)) / "checkpoints" / f"{posixpath.basename(root.rstrip('/'))}-{key}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not dest.is_dir():
            # Into a directory of its own, renamed when complete: a process killed midway leaves no
            # partial copy under the name the next one reuses.
            tmp = dest.with_name(f"{dest.name}.partial-{uuid.uuid4().hex[:8]}")
            for f in files:
                target = tmp / posixpath.relpath(f, root)
                target.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f, str(target))
            faults = manifest_faults(tmp)
            if faults:
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointDamaged(location, faults)
            tmp.rename(dest)
    return dest


def manifest_faults(local: Path) -> list[str]:
    """What is wrong with the files in the local directory ``local`` against the manifest among them
    (``[]`` when they match, or when there is none: not a checkpoint, or one written before manifests)."""
    manifest = local / MANIFEST
    if not manifest.is_file():
        return []
    try:
        return compare(local, parse_manifest(manifest.read_text()))
    except ManifestError as e:
        return [f"{MANIFEST}: {e}"]
