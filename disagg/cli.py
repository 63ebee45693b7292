"""The ``disagg`` command: ``train`` and ``generate`` (hydra), ``ctl`` (gRPC client).

``disagg train key=value ...`` composes ``configs/train.yaml`` with hydra,
validates it into dataclasses before any actor starts (one message naming the
key and the value on error), runs the job, and prints the run directory last.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

from disagg.config.files import CONFIG_DIR  # the Hydra configs: the wheel's, else the checkout's

USAGE = """usage: disagg <command> [args]

commands:
  train [key=value ...]   run RL training (hydra overrides, e.g. trainer.total_steps=20)
  generate [key=value ...] standalone engines on real weights (model.path) + the reward: debug an engine or a reward
  ctl <subcommand> ...    talk to a running job's coordinator (disagg ctl status --address HOST:PORT)
  bench transport [flags] weight-sync benchmark against raw, per-parameter and object-store baselines
  bench pipeline [flags]  stream vs batch, reward overlap, async vs sync (CPU or --device cuda)
  bench vllm-sync [flags] a sync into a real vLLM engine phase by phase vs a raw broadcast, per load mode
  bench soak [flags]      30 min of training with a pause/resume and an engine kill: RSS, nothing lost
"""


def _hydra_command(argv: list[str], mode: str) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from disagg.config import RENAMED_KEYS, load_config
    from disagg.errors import ConfigError
    from disagg.logs import setup_logging
    from disagg.paths import run_dir_of, runs_root

    for arg in argv:  # hydra would only say that a replaced key is not in the config
        key = arg.lstrip("+~").split("=", 1)[0]
        if key in RENAMED_KEYS:
            print(f"disagg: invalid config: {RENAMED_KEYS[key]}", file=sys.stderr)
            return 2
    # 0 unless the task says otherwise: hydra's --cfg/--help/--info print and return without running
    # it, and a task that raises makes hydra exit 1 itself.
    result: dict[str, int] = {"rc": 0}
    # hydra.run.dir is <this>/<time> (configs/train.yaml): a default root never lies in a Ray job's
    # working-dir package, and disagg.paths.RunDirCheck refuses any run directory there before hydra
    # creates it.
    OmegaConf.register_new_resolver("disagg_runs_root", lambda root: str(runs_root(root, Path.cwd(), os.environ)),
                                    replace=True)

    @hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base="1.3")
    def _main(dc) -> None:
        from disagg.generate import run_generate
        from disagg.train import run

        setup_logging("driver", dc.logging.level if "logging" in dc else "INFO")
        try:
            cfg = load_config(OmegaConf.to_container(dc, resolve=True), mode=mode)
            run_dir = run_dir_of(cfg.run_dir, HydraConfig.get().runtime.output_dir)
            try:
                if mode == "train":
                    run_dir = Path(run(cfg, run_dir))  # a resume goes on in the resumed run's directory
                else:
                    run_generate(cfg, run_dir)
            finally:
                import ray

                ray.shutdown()
        except ConfigError as e:
            print(f"disagg: invalid config: {e}", file=sys.stderr)
            result["rc"] = 2
            return
        result["rc"] = 0
        print(f"run directory: {run_dir}", flush=True)

    sys.argv = [f"disagg {mode}", *argv]
    _main()
    return result["rc"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("train", "generate"):
        return _hydra_command(rest, cmd)
    if cmd == "ctl":
        from disagg.control.ctl import main as ctl_main

        return ctl_main(rest)
    if cmd == "bench":
        from disagg.bench import main as bench_main

        return bench_main(rest)
    print(f"disagg: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def run() -> NoReturn:
    """The ``disagg`` program (its console script and ``python -m disagg``): ``main``, then
    ``exit_quietly``. Code that calls ``main`` in-process (tests) keeps its interpreter."""
    import traceback

    try:
        rc = main()
    except SystemExit as e:  # hydra and argparse exit this way
        if isinstance(e.code, int) or e.code is None:
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except KeyboardInterrupt:
        print("disagg: interrupted", file=sys.stderr)
        rc = 130
    except BaseException:
        traceback.print_exc()
        rc = 1
    exit_quietly(rc)


def exit_quietly(rc: int) -> NoReturn:
    """End the process with ``rc`` after Python's exit handlers (``atexit``: Ray's shutdown,
    logging, temporary directories), but without the interpreter's teardown of extension
    modules. That teardown is where Triton's nanobind bindings (imported with vLLM) report
    hundreds of "leaked function" lines on stderr, which buried a run's summary and its
    ``run directory:`` line; nothing of disagg's is left to flush by then."""
    import atexit
    import os

    from disagg.logs import flush_std_streams

    try:
        atexit._run_exitfuncs()
    finally:
        flush_std_streams()
        os._exit(rc)


if __name__ == "__main__":
    run()
