"""``disagg ctl``: look at and steer a running coordinator from a shell.

``disagg ctl status`` shows the run, the pools and every engine (state, served
policy version, how long since it was last heard from); ``--json`` prints the
same snapshot for scripts. ``disagg ctl set-staleness N`` changes how far
rollouts may lag the trainer while the run goes on. The top-level CLI
(``disagg/cli.py``) hands ``argv`` after ``ctl`` to ``main``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rich.console import Console
from rich.table import Table

from disagg.control.client import CoordinatorClient
from disagg.control.types import ClusterStatus, EngineState
from disagg.errors import ControlError

ADDRESS_ENV = "DISAGG_COORDINATOR"

_STATE_STYLE = {
    EngineState.STARTING: "cyan",
    EngineState.WAITING_FOR_WEIGHTS: "yellow",
    EngineState.READY: "green",
    EngineState.SYNCING: "blue",
    EngineState.DRAINING: "magenta",
    EngineState.DEAD: "bold red",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg ctl", description="Inspect and steer a running disagg coordinator.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=os.environ.get(ADDRESS_ENV),
                        help=f"coordinator HOST:PORT (default: ${ADDRESS_ENV})")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the coordinator (default 10)")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", parents=[common], help="show pools, engines and policy versions")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    stale = sub.add_parser("set-staleness", parents=[common], help="set the max policy staleness of rollouts")
    stale.add_argument("value", type=int, help="max versions a rollout may lag the trainer (>= 0)")
    return parser


def main(argv: list[str]) -> int:
    """Run ``disagg ctl``; return the process exit code (0 ok, 1 coordinator error, 2 usage)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on usage errors
        return int(e.code or 0)
    if not args.address:
        print(f"disagg ctl: no coordinator address: pass --address HOST:PORT or set ${ADDRESS_ENV}", file=sys.stderr)
        return 2
    try:
        with CoordinatorClient(args.address, timeout_s=args.timeout) as client:
            if args.command == "status":
                status = client.get_status()
                if args.json:
                    print(json.dumps(status.to_dict(), indent=2))
                else:
                    console = Console()
                    if not console.is_terminal:  # piped or captured: don't squeeze into 80 columns
                        console = Console(width=160)
                    render_status(status, console)
            else:
                value = client.set_max_staleness(args.value)
                print(f"max_staleness is now {value}")
    except (ControlError, ValueError) as e:
        print(f"disagg ctl: {e}", file=sys.stderr)
        return 1
    return 0


def render_status(status: ClusterStatus, console: Console) -> None:
    """Print the header, the pools table and the engines table."""
    now = time.time()
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column()
    header.add_row("run dir", status.run_dir or "-")
    header.add_row("uptime", _age(now - status.started_unix_s))
    header.add_row("trainer step", str(status.trainer_step))
    header.add_row("latest version", str(status.latest_version))
    header.add_row("committed version", str(status.committed_version))
    header.add_row("max staleness", str(status.max_staleness))
    console.print(header)

    pools = Table(title="pools", title_justify="left")
    for col in ("name", "bundles", "bundle resources", "workers", "placement group"):
        pools.add_column(col)
    for p in status.pools:
        pools.add_row(p.name, str(p.num_bundles), p.bundle_resources, str(p.num_workers), p.placement_group_id)
    console.print(pools)

    engines = Table(title="engines", title_justify="left")
    for col in ("id", "state", "version", "pid"):
        engines.add_column(col, no_wrap=True)
    for col in ("node", "address", "updated", "message"):
        engines.add_column(col, overflow="fold")
    for e in status.engines:
        engines.add_row(
            str(e.engine_id),
            f"[{_STATE_STYLE[e.state]}]{e.state.value}[/]",
            str(e.policy_version),
            str(e.pid),
            e.node_ip,
            e.address or "-",
            _age(now - e.last_update_unix_s) + " ago",
            e.message,
        )
    console.print(engines)


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
