"""Where a run directory goes: never inside a directory Ray owns.

``ray job submit --working-dir .`` unpacks the upload into
``<ray temp>/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>/`` and starts the
driver there. Ray replaces that package when another job uploads and deletes it with the session,
so a run directory resolved against that cwd (the old default ``runs/<time>``) loses the metrics
and checkpoints, or fails midway when the package goes. This module picks the root of run
directories (``logging.root_dir``, ``$DISAGG_RUNS_DIR``, else ``runs`` under the directory the
user launched from, else ``~/disagg-runs`` inside a Ray package) and refuses any path inside a Ray
package with a ConfigError naming the key to set, before hydra creates the directory
(``RunDirCheck``). It never creates anything.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf.errors import InterpolationResolutionError

from disagg.errors import ConfigError

RUNS_DIR_ENV = "DISAGG_RUNS_DIR"
"""Environment variable: the root of run directories when ``logging.root_dir`` is null."""
DEFAULT_ROOT = "runs"
"""The root under the launch directory (outside Ray packages)."""
RAY_JOB_ROOT = "~/disagg-runs"
"""The root when the launch directory is a Ray job's working-dir package."""


def ray_package_of(path: Path) -> Path | None:
    """The Ray-owned directory ``path`` lies in - a job's unpacked working_dir or py_modules
    (``_ray_pkg_<hash>``) or anything under a session's ``runtime_resources`` - else None."""
    parts = Path(path).parts
    for i, part in enumerate(parts):
        if part.startswith("_ray_pkg_") or part == "runtime_resources":
            return Path(*parts[: i + 1])
    return None


def check_outside_ray_package(path: Path, key: str, value: object, example: str = "/shared/runs/<name>") -> Path:
    """``path`` (absolute), or a ConfigError quoting ``key=value`` if it lies inside a Ray package."""
    pkg = ray_package_of(path)
    if pkg is not None:
        raise ConfigError(
            f"{key}={value!r} resolves to {path}, inside {pkg}, a directory Ray owns (a job's working-dir "
            f"package: Ray replaces it and deletes it with the session, and the run's metrics and checkpoints "
            f"with it). Set {key} to an absolute path outside it, e.g. {key}={example}")
    return path


def runs_root(root_dir: str | None, cwd: Path, env: Mapping[str, str]) -> Path:
    """The absolute directory new run directories go under.

    ``logging.root_dir`` if set, else ``$DISAGG_RUNS_DIR``, else ``runs`` under ``cwd``; a relative
    value is taken against ``cwd`` and ``~`` is expanded. When ``cwd`` is inside a Ray package (the
    driver of ``ray job submit --working-dir``) and neither is set, the default is ``~/disagg-runs``
    on the driver's node instead. A root inside a Ray package is a ConfigError naming the key.
    """
    if root_dir is not None:
        key, value = "logging.root_dir", root_dir
    elif env.get(RUNS_DIR_ENV):
        key, value = RUNS_DIR_ENV, env[RUNS_DIR_ENV]
    elif ray_package_of(cwd) is not None:
        key, value = "logging.root_dir", RAY_JOB_ROOT
    else:
        key, value = "logging.root_dir", DEFAULT_ROOT
    root = Path(os.path.expanduser(value))
    if not root.is_absolute():
        root = cwd / root
    return check_outside_ray_package(Path(os.path.normpath(root)), key, value, "/shared/disagg-runs")


def run_dir_of(run_dir: str | None, hydra_run_dir: str) -> Path:
    """The run directory of ``disagg train`` / ``generate``: ``run_dir`` if set, else hydra's
    ``hydra.run.dir``; absolute, and never inside a Ray package (a ConfigError naming the key)."""
    key, value = ("run_dir", run_dir) if run_dir else ("hydra.run.dir", hydra_run_dir)
    return check_outside_ray_package(Path(os.path.expanduser(value)).resolve(), key, value)


class RunDirCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in configs/train.yaml): before hydra creates the run
    directory, resolve it and end the command with the config error (exit status 2, as any invalid
    config) if it would lie inside a Ray package."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        # Hydra turns an exception of a callback into a warning and goes on: only SystemExit stops it.
        try:
            try:
                hydra_run_dir = str(config.hydra.run.dir)
            except InterpolationResolutionError:
                # The default's resolver (runs_root) refused the root: the same call raises its ConfigError.
                runs_root(config.logging.root_dir, Path.cwd(), os.environ)
                raise
            run_dir_of(config.get("run_dir"), hydra_run_dir)
        except ConfigError as e:
            print(f"disagg: invalid config: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
