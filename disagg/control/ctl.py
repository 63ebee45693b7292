"""``disagg ctl``: look at and steer a running job from a shell.

One subcommand per Ops call: ``status`` (pools, engines with state / version /
load and vLLM's ``/metrics`` address, trainer step, staleness limit, buffer, the
coordinator's Prometheus endpoint), ``pause`` / ``resume`` (the
rollout), ``set-staleness N``, ``scale N`` (rollout engines), ``checkpoint``, ``stop`` (graceful: finish the
step, checkpoint, exit 0) and ``watch`` (per-step metrics as they come); ``complete PROMPT`` asks an
engine's OpenAI API, with the key it asks off loopback (the control token by default).
``--run-dir`` finds the job's address and token in its run directory;
``--address`` / ``--token`` / ``--token-file`` override them; ``--json`` prints
machine-readable output. The top-level CLI (``disagg/cli.py``) hands ``argv``
after ``ctl`` to ``main``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.markup import escape
from rich.console import Console
from rich.table import Table

from disagg.control.auth import TOKEN_FILE, read_token
from disagg.control.client import CoordinatorClient
from disagg.control.types import ClusterStatus, EngineState
from disagg.errors import ControlError

VERSION_MAX_HEADER = "x-disagg-policy-version-max"
"""The engines' response header (``disagg.rollout.types``; a wire name, spelled here so that the control
package does not import the rollout package, which imports it)."""

ADDRESS_ENV = "DISAGG_COORDINATOR"
RUN_DIR_ENV = "DISAGG_RUN_DIR"
TOKEN_ENV = "DISAGG_TOKEN"

_STATE_STYLE = {
    EngineState.STARTING: "cyan",
    EngineState.WAITING_FOR_WEIGHTS: "yellow",
    EngineState.READY: "green",
    EngineState.SYNCING: "blue",
    EngineState.DRAINING: "magenta",
    EngineState.DEAD: "bold red",
}

# The metrics `watch` shows in its table (all of them with --json).
WATCH_COLUMNS = [("reward/mean", "reward", "{:.3f}"), ("policy_version", "version", "{:.0f}"),
                 ("policy/staleness_max", "stale", "{:.0f}"), ("timing/step_s", "step s", "{:.2f}"),
                 ("timing/weight_sync_s", "sync s", "{:.3f}"), ("throughput/samples_per_s", "samples/s", "{:.0f}"),
                 ("train/loss", "loss", "{:.4f}")]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg ctl", description="Inspect and steer a running disagg job.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", default=os.environ.get(RUN_DIR_ENV),
                        help=f"the job's run directory: address and token from it (default: ${RUN_DIR_ENV})")
    common.add_argument("--address", default=os.environ.get(ADDRESS_ENV),
                        help=f"coordinator HOST:PORT (default: ${ADDRESS_ENV}, else <run-dir>/coordinator.addr)")
    common.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                        help=f"the job's control token (default: ${TOKEN_ENV}, else --token-file)")
    common.add_argument("--token-file", default=None, help=f"file holding the token (default: <run-dir>/{TOKEN_FILE})")
    common.add_argument("--tls-ca", default=None, help="PEM to verify a TLS coordinator against")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the coordinator (default 10)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", parents=[common], help="pools, engines, versions, buffer")
    stale = sub.add_parser("set-staleness", parents=[common], help="set the max policy staleness of rollouts")
    stale.add_argument("value", type=int, help="max versions a rollout may lag the trainer (>= 0)")
    scale = sub.add_parser("scale", parents=[common], help="grow or shrink the rollout pool to N engines")
    scale.add_argument("num_engines", type=int, help="engines once scaling settles (>= 1)")
    scale.add_argument("--reason", default="", help="logged by the job")
    for name, what in (("pause", "stop starting new prompt groups (in-flight ones finish)"),
                       ("resume", "resume a paused rollout"),
                       ("stop", "finish the step in progress, checkpoint, exit 0")):
        sp = sub.add_parser(name, parents=[common], help=what)
        sp.add_argument("--reason", default="", help="logged by the job")
    ck = sub.add_parser("checkpoint", parents=[common], help="checkpoint after the step in progress")
    ck.add_argument("--wait", type=float, default=600.0, help="seconds to wait for it (default 600)")
    comp = sub.add_parser("complete", parents=[common],
                          help="ask an engine's OpenAI API for a completion (sends the key it asks off loopback)")
    comp.add_argument("prompt", help="the prompt text")
    comp.add_argument("--engine", type=int, default=None, help="engine id (default: the first ready engine)")
    comp.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    comp.add_argument("--api-key-env", default=None,
                      help="environment variable holding the engines' key (rollout.api_key=env:NAME); default: "
                           "the control token, the engines' key unless rollout.api_key names another")
    comp.add_argument("--api-ca", default=None, help="PEM to verify an HTTPS engine against (rollout.api_tls_ca)")
    watch = sub.add_parser("watch", parents=[common], help="stream per-step metrics until the job ends")
    watch.add_argument("--from-step", type=int, default=0, help="replay from this step (default: new steps only)")
    return parser


def _connect(args) -> CoordinatorClient:
    run_dir = Path(os.path.expanduser(args.run_dir)) if args.run_dir else None
    address = args.address
    if not address and run_dir is not None:
        try:
            address = (run_dir / "coordinator.addr").read_text().strip()
        except OSError as e:
            raise _Usage(f"no coordinator address in {run_dir}: {e.strerror} (is it a run directory of a live job?)")
    if not address:
        raise _Usage(f"no coordinator address: pass --run-dir DIR or --address HOST:PORT (or set ${RUN_DIR_ENV} / "
                     f"${ADDRESS_ENV})")
    token = args.token
    if not token:
        token_file = args.token_file or (run_dir / TOKEN_FILE if run_dir is not None else None)
        if token_file is not None:
            token = read_token(token_file)
    return CoordinatorClient(address, timeout_s=args.timeout, token=token, tls_ca=args.tls_ca)


class _Usage(Exception):
    pass


def main(argv: list[str]) -> int:
    """Run ``disagg ctl``; return the process exit code (0 ok, 1 job/coordinator error, 2 usage)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on usage errors
        return int(e.code or 0)
    try:
        client = _connect(args)
    except _Usage as e:
        print(f"disagg ctl: {e}", file=sys.stderr)
        return 2
    except ControlError as e:
        print(f"disagg ctl: {e}", file=sys.stderr)
        return 1
    try:
        with client:
            return _run(args, client)
    except (ControlError, ValueError) as e:
        print(f"disagg ctl: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(args, client: CoordinatorClient) -> int:
    cmd = args.command
    if cmd == "status":
        status = client.status()
        if args.json:
            print(json.dumps(status.to_dict(), indent=2))
        else:
            render_status(status, _console())
    elif cmd == "set-staleness":
        value = client.set_max_staleness(args.value)
        _say(args, {"max_staleness": value}, f"max_staleness is now {value}")
    elif cmd == "scale":
        message = client.scale_rollout(args.num_engines, args.reason)
        _say(args, {"message": message, "num_engines": args.num_engines}, message)
    elif cmd in ("pause", "resume", "stop"):
        fn = {"pause": client.pause_rollout, "resume": client.resume_rollout, "stop": client.stop}[cmd]
        message = fn(args.reason)
        _say(args, {"message": message}, message)
    elif cmd == "checkpoint":
        step, version, path = client.checkpoint(timeout_s=args.wait)
        _say(args, {"step": step, "policy_version": version, "path": path},
             f"checkpoint of step {step} (policy version {version}): {path}")
    elif cmd == "complete":
        reply = complete(args, client)
        _say(args, reply, f"engine {reply['engine_id']} (policy version {reply['policy_version']}): {reply['text']}")
    elif cmd == "watch":
        if args.from_step < 0:
            print(f"disagg ctl: --from-step={args.from_step}: must be >= 0", file=sys.stderr)
            return 2
        console = _console()
        if not args.json:
            console.print(f"{'step':>6}  " + "  ".join(f"{title:>10}" for _, title, _ in WATCH_COLUMNS))
        for step, values in client.watch_metrics(args.from_step):
            if args.json:
                print(json.dumps({"step": step, **values}), flush=True)
            else:
                cells = [(fmt.format(values[k]) if k in values else "-") for k, _, fmt in WATCH_COLUMNS]
                console.print(f"{step:>6}  " + "  ".join(f"{c:>10}" for c in cells))
    return 0


def complete(args, client: CoordinatorClient) -> dict:
    """``POST /v1/completions`` to the engine ``args`` names (else the first ready one), found through
    the coordinator, with ``Authorization: Bearer <key>``: the key from ``--api-key-env``, else the
    control token ``client`` holds. A ControlError says why an engine could not answer."""
    import ssl
    import urllib.error
    import urllib.request

    engines = {e.engine_id: e for e in client.status().engines if e.address}
    ready = [i for i, e in sorted(engines.items()) if e.state == EngineState.READY]
    eid = args.engine if args.engine is not None else (ready[0] if ready else None)
    if eid not in engines:
        raise ControlError(f"no engine {eid} serving the OpenAI API (engines with an address: "
                           f"{sorted(engines) or 'none'}; ready: {ready or 'none'})")
    key = client.token
    if args.api_key_env:
        key = os.environ.get(args.api_key_env, "").strip()
        if not key:
            raise ControlError(f"--api-key-env {args.api_key_env}: the environment variable is unset or empty")
    url = f"{engines[eid].address}/v1/completions"
    try:
        body = json.dumps({"model": _served_model(engines[eid].address, key, args.api_ca), "prompt": args.prompt,
                           "max_tokens": args.max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(url, data=body, headers={"content-type": "application/json",
                                                                  **({"authorization": f"Bearer {key}"} if key else {})})
        with urllib.request.urlopen(request, timeout=max(args.timeout, 60.0), context=_tls(args.api_ca)) as resp:
            reply = json.loads(resp.read())
            version = resp.headers.get(VERSION_MAX_HEADER)
    except urllib.error.HTTPError as e:
        raise ControlError(f"{url}: {e.code} {e.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, ssl.SSLError, OSError) as e:
        raise ControlError(f"{url}: {getattr(e, 'reason', e)}") from None
    return {"engine_id": eid, "policy_version": int(version) if version else None,
            "text": reply["choices"][0]["text"], "finish_reason": reply["choices"][0]["finish_reason"]}


def _tls(ca: str | None):
    import ssl

    return ssl.create_default_context(cafile=os.path.expanduser(ca)) if ca else None


def _served_model(address: str, key: str | None, ca: str | None) -> str:
    """The model name the engine serves (its ``/v1/models``)."""
    import urllib.request

    request = urllib.request.Request(f"{address}/v1/models", headers={"authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=30, context=_tls(ca)) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _say(args, data: dict, text: str) -> None:
    print(json.dumps(data) if args.json else text)


def _console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=160)  # piped: don't squeeze into 80 columns


def _last_sync(s) -> str:
    """The latest step's weight sync in a line: its mode and what went on the wire."""
    if s is None:
        return "-"
    how = (f"delta ({s.changed_fraction:.2%} of the elements changed)" if s.delta else "dense")
    return (f"step {s.step}: {how}, {s.bytes_on_wire / 1e6:.3g} of {s.bytes / 1e6:.3g} MB on the wire, "
            f"{s.seconds:.3f} s")


def render_status(status: ClusterStatus, console: Console) -> None:
    """Print the header, the pools table and the engines table."""
    now = time.time()
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column()
    header.add_row("run dir", status.run_dir or "-")
    header.add_row("uptime", _age(now - status.started_unix_s))
    header.add_row("phase", status.phase or "-")
    header.add_row("trainer step", f"{status.trainer_step}" + (f" of {status.total_steps}" if status.total_steps else ""))
    header.add_row("trainer version", str(status.trainer_version))
    header.add_row("latest version", str(status.latest_version))
    header.add_row("committed version", str(status.committed_version))
    header.add_row("max staleness", str(status.max_staleness))
    live = sum(1 for e in status.engines if e.state not in (EngineState.DRAINING, EngineState.DEAD))
    scaling = f", scaling to {status.target_engines} engines" if status.target_engines and status.target_engines != live else ""
    header.add_row("rollout", ("paused" if status.rollout_paused else "running") + scaling)
    header.add_row("groups", f"{status.inflight_groups} in flight, {status.buffer_groups} ready to train")
    header.add_row("metrics", status.metrics_url or "no Prometheus endpoint (control.metrics_port=null)")
    header.add_row("last sync", _last_sync(status.last_sync))
    console.print(header)

    pools = Table(title="pools", title_justify="left")
    for col in ("name", "bundles", "bundle resources", "workers", "placement group"):
        pools.add_column(col)
    for p in status.pools:
        pools.add_row(p.name, str(p.num_bundles), p.bundle_resources, str(p.num_workers), p.placement_group_id)
    console.print(pools)

    engines = Table(title="engines", title_justify="left")
    for col in ("id", "state", "version", "in flight", "tok/s", "pid"):
        engines.add_column(col, no_wrap=True)
    for col in ("node", "address", "vLLM /metrics", "updated", "message"):
        engines.add_column(col, overflow="fold")
    for e in status.engines:
        engines.add_row(
            str(e.engine_id),
            f"[{_STATE_STYLE[e.state]}]{e.state.value}[/]",
            str(e.policy_version),
            str(e.inflight_groups),
            f"{e.tokens_per_s:.0f}",
            str(e.pid),
            e.node_ip,
            e.address or "-",
            e.vllm_metrics_url or "none: no HTTP server (rollout.openai_api=false)",
            _age(now - e.last_update_unix_s) + " ago",
            escape(e.message),  # errors quote "[file:line]": not rich markup
        )
    console.print(engines)
    if status.events:
        events = Table(title="events (latest last)", title_justify="left")
        events.add_column("when", no_wrap=True)
        events.add_column("kind", no_wrap=True)
        events.add_column("what", overflow="fold")
        for ev in status.events[-10:]:
            events.add_row(_age(now - ev.unix_s) + " ago", ev.kind, escape(ev.message))
        console.print(events)


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
