"""Where run directories go: the root from logging.root_dir / $DISAGG_RUNS_DIR / the launch
directory, ~/disagg-runs when launched inside a Ray job's working-dir package, and a ConfigError
naming the key for any run directory inside such a package."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.errors import ConfigError
from disagg.paths import ray_package_of, run_dir_of, runs_root

PKG = Path("/tmp/ray/session_2026-11-24_10-00-00_1_1/runtime_resources/working_dir_files/_ray_pkg_0d1e2f3a")
RUNTIME = PKG.parents[1]  # the session's runtime_resources: all of it is Ray's
PROJECT = Path("/home/user/project")


@pytest.mark.parametrize("path, package", [
    (PKG, RUNTIME),
    (PKG / "runs" / "x", RUNTIME),
    (Path("/tmp/ray/session_1/runtime_resources/py_modules_files/m"), Path("/tmp/ray/session_1/runtime_resources")),
    (Path("/scratch/dg-mn-1/head/session_latest/runtime_resources/working_dir_files/_ray_pkg_1/a"),
     Path("/scratch/dg-mn-1/head/session_latest/runtime_resources")),  # another --temp-dir
    (Path("/data/_ray_pkg_ab/runs"), Path("/data/_ray_pkg_ab")),
    (PROJECT / "runs", None),
    (Path("/tmp/ray/session_1/logs"), None),  # the session's own files are not a package
    (Path("/home/user/my_ray_pkg_notes"), None),
])
def test_ray_package_of(path, package):
    assert ray_package_of(path) == package


@pytest.mark.parametrize("root_dir, env, cwd, expected", [
    (None, {}, PROJECT, PROJECT / "runs"),  # the default: runs under the launch directory
    ("out", {}, PROJECT, PROJECT / "out"),
    ("/abs/runs", {}, PKG, Path("/abs/runs")),
    (None, {"DISAGG_RUNS_DIR": "/data/runs"}, PKG, Path("/data/runs")),
    ("/abs/runs", {"DISAGG_RUNS_DIR": "/data/runs"}, PROJECT, Path("/abs/runs")),  # the config key wins
    (None, {"DISAGG_RUNS_DIR": ""}, PROJECT, PROJECT / "runs"),
    (None, {}, PKG, Path("/home/tester/disagg-runs")),  # a `ray job submit --working-dir` driver
    ("~/r", {}, PROJECT, Path("/home/tester/r")),
    ("../r", {}, PROJECT, Path("/home/user/r")),
])
def test_runs_root(monkeypatch, root_dir, env, cwd, expected):
    monkeypatch.setenv("HOME", "/home/tester")
    assert runs_root(root_dir, cwd, env) == expected


@pytest.mark.parametrize("root_dir, env, cwd, needle", [
    ("runs", {}, PKG, "logging.root_dir='runs' resolves to " + str(PKG / "runs")),
    (None, {"DISAGG_RUNS_DIR": "rr"}, PKG, "DISAGG_RUNS_DIR='rr' resolves to " + str(PKG / "rr")),
    (str(PKG / "x"), {}, PROJECT, f"logging.root_dir={str(PKG / 'x')!r}"),
])
def test_a_root_inside_a_ray_package_is_a_config_error_naming_the_key(root_dir, env, cwd, needle):
    with pytest.raises(ConfigError) as e:
        runs_root(root_dir, cwd, env)
    assert str(e.value).startswith(needle) and f"inside {RUNTIME}," in str(e.value)


def test_run_dir_of_prefers_run_dir_and_refuses_a_ray_package(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert run_dir_of(None, "runs/20260101-000000") == tmp_path / "runs" / "20260101-000000"
    assert run_dir_of("mine", "runs/20260101-000000") == tmp_path / "mine"
    pkg = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    pkg.mkdir(parents=True)
    monkeypatch.chdir(pkg)
    for key, args in (("run_dir", ("r", "/abs/x")), ("hydra.run.dir", (None, "runs/t"))):
        with pytest.raises(ConfigError, match=f"^{key}="):
            run_dir_of(*args)
    assert run_dir_of(None, "/abs/x") == Path("/abs/x")
