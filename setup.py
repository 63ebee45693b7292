"""Build hook: generate the coordinator's gRPC stubs at install time.

All metadata lives in pyproject.toml; this file only adds commands. The stubs
(disagg/control/_proto) are never committed, so every build makes them with the
grpcio-tools listed in ``[build-system] requires``:

- ``pip install .``: ``build_py`` writes them into the build tree, so the wheel
  carries them even when the source tree has none.
- ``pip install -e .``: ``editable_wheel`` writes them into the source tree,
  which the editable install puts on ``sys.path``. It is hooked here rather than
  in ``build_py`` because setuptools turns a failing custom ``build_py`` into a
  warning in editable mode, and a failed generation must fail the install.

A non-editable build also copies the Hydra configs (``configs/``) into the
package as ``disagg/configs``, where ``disagg.config.files.CONFIG_DIR`` finds them when
there is no checkout around the installed package.

The generator itself is ``disagg/control/gen.py`` (also ``python -m
disagg.control.gen``), loaded by path because ``disagg`` is not importable in
the isolated build environment.
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
STUB_DIR = Path("disagg", "control", "_proto")


def _generate(out_dir: Path) -> None:
    spec = importlib.util.spec_from_file_location("_disagg_control_gen", ROOT / "disagg" / "control" / "gen.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for path in gen.generate(ROOT / "protos", out_dir):
        print(f"disagg: generated {path}")


class BuildPyWithStubs(build_py):
    """Copy the sources, then generate the stubs and copy the configs into the build tree."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            # After super().run(): a stale _proto in the source tree, copied
            # above, is overwritten by stubs made from the current protos.
            _generate(Path(self.build_lib) / STUB_DIR)
            configs = Path(self.build_lib, "disagg", "configs")
            shutil.rmtree(configs, ignore_errors=True)
            shutil.copytree(ROOT / "configs", configs, ignore=shutil.ignore_patterns("__pycache__"))


class EditableWheelWithStubs(editable_wheel):
    """Generate the stubs into the source tree before the editable wheel is made."""

    def run(self) -> None:
        _generate(ROOT / STUB_DIR)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs, "editable_wheel": EditableWheelWithStubs})
