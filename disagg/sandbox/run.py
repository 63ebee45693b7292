"""Run a model's Python answer against assert tests in a limited subprocess, judged outside it.

The answer runs in a fresh interpreter (``python -I -S -B``) in a temporary
directory that is deleted afterwards, with stdin closed, a minimal environment,
and resource limits on address space, CPU time, file size and open files. It
must never take the calling process down: whatever the answer does (loops,
allocates, forks, exits early, floods stderr) comes back as a ``SandboxResult``;
only misuse by the caller raises.

Filesystem (``filesystem_isolation``, see ``disagg.sandbox.fs``): the answer
sees a read-only system and Python install, a private /tmp and its own temporary
directory, nothing of the job (run directory, checkpoints, caches, project, home),
and runs as nobody when the caller is root. It is built by bubblewrap (``"bwrap"``)
where installed, else by this module's own mount namespace (``"namespaces"``); where
neither is permitted (``"none"``) the answer sees what the caller's user sees, which
is logged once as a warning (``require_filesystem_isolation`` makes it an error).

This is defence in depth for rewarding an RL policy, not a hardened boundary
against hostile code (no seccomp filter; the kernel is shared). Run code you do
not trust inside a container or VM as well.

Process layout. The exec'd interpreter is a supervisor that never runs user
code: it forks one child that runs the answer then the tests' expressions, enforces the
timeout by killing it, and, as a child subreaper, kills and reaps everything
the child left behind before it exits, so no process and no zombie outlives a
run. The caller SIGKILLs the supervisor's children and its process group as a
backstop if it overruns. Where the caller may create namespaces (root here),
the child is also put in:

- a new network namespace (``network_isolation="netns"``): only a downed
  loopback, nothing reachable. Without it (``"prelude"``) the only barrier is
  the prelude that replaces the ``socket``/``_socket`` constructors and
  resolvers with functions raising ``PermissionError`` (applied in both cases);
- a new PID namespace (``process_isolation="pidns"``) whose init is the child:
  when it dies the kernel kills and reaps everything in it, and on Linux >= 6.14
  its ``pid_max`` caps it at ~300 processes. It leads its own process group,
  so nothing in the namespace can signal the supervisor. Without it
  (``"group"``) the child stays in the supervisor's group (the caller's kill
  reaches it even if the answer killed the supervisor) and the supervisor
  walks the process tree.

With bwrap, bwrap makes both namespaces and the supervisor is the PID
namespace's init (bwrap runs it ``--as-pid-1``): the kernel kills what is left
when it exits, and nothing in the namespace can signal it. When the caller is
root and the filesystem is isolated, the child drops to nobody before it reads
the answer.

Fork bombs. RLIMIT_NPROC counts every thread of the real user, and the kernel
exempts root from it, so when the answer runs as root it is left unset (it
would neither fail the exec nor stop a fork) and the PID namespace's pid_max
is the bound; otherwise it is set to the current thread count of the user the
answer runs as (nobody, or the caller) plus ``_NPROC_MARGIN``. Either way the
timeout kills the lot.

The verdict is the caller's, never the box's: the answer runs in the child, so it
can rewrite anything there (frames, builtins, the harness, the results pipe). Each
test ``assert <expr> == <literal>`` (``disagg.sandbox.checks``) is split: only
``<expr>`` enters the box; the child reports its value as data of exact built-in
types, and the caller compares that with the literal. A pass needs every test's
value, each reported once and each holding, and the child to finish (so
``os._exit(0)`` before the tests scores as an error). An object with a forged
``__eq__`` is not data and fails; a value the answer writes itself is a guess at
expected values that are in no file, argument or memory of the box.

Linux only (/proc, unshare, prctl, mount). ``preexec_fn`` is what the limits and
namespaces need; it runs Python between fork and exec, which CPython warns can
deadlock in a process whose other threads hold locks at that moment, so it
only calls pre-resolved libc functions, ``os`` system calls and ``setrlimit``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import platform
import resource
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from disagg.errors import SandboxError
from disagg.sandbox import checks as sandbox_checks, fs as sandbox_fs
from disagg.sandbox.checks import Check
from disagg.sandbox.fs import NOBODY

log = logging.getLogger("disagg.sandbox")

Reason = Literal["passed", "failed", "error", "timeout", "memory", "syntax", "no_code"]
Filesystem = Literal["bwrap", "namespaces", "none"]

_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38

_FILE_SIZE_BYTES = 4 << 20
_NUM_FILES = 64
_NPROC_MARGIN = 64
_PID_MAX_IN_NS = 301  # the kernel's minimum pid_max: at most ~300 processes in the namespace
_GRACE_S = 2.0  # on top of timeout_s: interpreter start-up and reaping, before the caller's backstop kill
_EXIT_TIMEOUT = 124  # supervisor's exit code when its timer killed the child
_DETAIL_CHARS = 500
_RESULTS_BYTES = 8 << 20  # what the caller keeps of the results pipe: the tests' values, encoded
_MEMORY_HINTS = ("MemoryError", "Cannot allocate memory", "out of memory")


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    reason: Reason
    detail: str
    """At most 500 characters: for a test that does not hold (judged here), the test and its expression's
    value ("AssertionError: assert add(2, 3) == 5 (add(2, 3) was -1)"); else the last non-empty line of the
    answer's stderr (the exception), or a note of ours when that is empty and the run timed out or exited early."""
    seconds: float
    """Wall time of the whole run, start-up and clean-up included."""
    network_isolation: Literal["netns", "prelude"] | None = None
    """How sockets were blocked; None when nothing ran (no_code)."""
    process_isolation: Literal["pidns", "group"] | None = None
    """How leftover processes were contained; None when nothing ran."""
    stderr: str = ""
    """The last ``max_output_bytes`` of the answer's stderr."""
    pgid: int | None = None
    """Session and process group of the run's supervisor; every process of the run is in this
    session unless it called setsid(). None when nothing ran."""
    stdout: str = ""
    """The last ``max_output_bytes`` of the answer's stdout; only ``run_snippet`` captures it."""
    filesystem_isolation: Filesystem | None = None
    """What built the answer's view of the filesystem ("none": it saw what the caller's user sees);
    None when nothing ran."""


def run_python(code: str, tests: str, *, timeout_s: float = 5.0, memory_bytes: int = 256 << 20,
               max_output_bytes: int = 64 << 10, use_namespaces: bool = True,
               filesystem: Filesystem | None = None) -> SandboxResult:
    """Run ``code`` in a sandboxed subprocess and judge ``tests`` (assert statements) against it.

    Each test's expression is evaluated in the answer's namespace, in order, and compared here
    (``sandbox_checks``); tests of another form raise ``ValueError`` naming the test
    (``sandbox_checks.parse_tests`` says why they are refused, not run with the answer). The
    first test that does not hold gives the reason: "failed" (its value differs, or is not data:
    exact None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset or dict, so an
    int subclass or a numpy scalar fails), "error" (it raised), else the run's.
    An assert's message is not evaluated.

    ``filesystem`` picks how the filesystem is isolated; None: the best this machine permits
    (``filesystem_isolation()``); a backend that does not work here raises ``SandboxError``.
    ``use_namespaces=False`` runs as on a machine that permits no namespaces, for tests of the
    fallbacks: no network, PID or mount namespace (only the prelude, the process-group kill
    and the rlimits apply; ``filesystem`` must be None or "none").
    """
    checks = sandbox_checks.parse_tests(tests)
    return _run_sandboxed(code, checks, timeout_s, memory_bytes, max_output_bytes, use_namespaces, False,
                          filesystem)


def run_snippet(code: str, *, timeout_s: float = 5.0, memory_bytes: int = 256 << 20,
                max_output_bytes: int = 64 << 10, use_namespaces: bool = True,
                filesystem: Filesystem | None = None) -> SandboxResult:
    """Run ``code`` alone in the same sandbox as ``run_python``, capturing the tail of its stdout.

    ``reason`` is "passed" when the code ran to its end, else as for ``run_python``.
    """
    return _run_sandboxed(code, [], timeout_s, memory_bytes, max_output_bytes, use_namespaces, True, filesystem)


def filesystem_isolation() -> Filesystem:
    """The filesystem isolation runs get by default here: the first of bwrap and namespaces that
    works (each tried once per process with a trial run), else "none", logged once."""
    global _default_filesystem
    with _probe_lock:
        if _default_filesystem is None:
            _default_filesystem = next((m for m in ("bwrap", "namespaces") if _probe_locked(m) is None), "none")
            if _default_filesystem == "none":
                log.warning("code sandbox: NO filesystem isolation, model code can read and write what uid %d "
                            "can (%s)", os.geteuid(), _why_none_locked())
            else:
                log.info("code sandbox: filesystem isolation by %s", _default_filesystem)
        return _default_filesystem


def filesystem_unavailable(mode: Filesystem) -> str | None:
    """Why ``mode`` cannot isolate the filesystem here, or None when it works (probed once)."""
    with _probe_lock:
        return _probe_locked(mode)


def require_filesystem_isolation() -> Filesystem:
    """The isolation runs get here; raises ``SandboxError`` saying why when it is "none"."""
    mode = filesystem_isolation()
    if mode == "none":
        with _probe_lock:
            why = _why_none_locked()
        raise SandboxError(f"the code sandbox cannot isolate the filesystem on this machine ({why}); "
                           "install bubblewrap (Debian: apt-get install bubblewrap) or permit mount/user "
                           "namespaces, or set reward.require_sandbox_isolation=false to run model code without")
    return mode


_probe_lock = threading.Lock()
_probes: dict[str, str | None] = {"none": None}
_default_filesystem: Filesystem | None = None


def _probe_locked(mode: str) -> str | None:
    if mode not in _probes:
        _probes[mode] = _probe(mode)
    return _probes[mode]


def _why_none_locked() -> str:
    return "; ".join(f"{m}: {_probe_locked(m)}" for m in ("bwrap", "namespaces"))


def _probe(mode: str) -> str | None:
    """None if a trial run in ``mode`` works and cannot see a file planted beside its directory."""
    if mode == "bwrap" and sandbox_fs.BWRAP is None:
        return "bwrap is not installed"
    if mode == "namespaces" and sandbox_fs.PIVOT_ROOT is None:
        return f"no pivot_root syscall number for {platform.machine()}"
    fd, planted = tempfile.mkstemp(prefix="disagg-sandbox-probe-")
    os.close(fd)
    try:
        r = _run_sandboxed(f"import os\nassert not os.path.exists({planted!r}), 'the box sees the host'\n", [],
                           30.0, 256 << 20, 4096, True, False, mode, trial=True)
    except SandboxError as e:  # the view could not be built
        return str(e).removeprefix(f"filesystem isolation {mode!r} failed: ")
    finally:
        os.unlink(planted)
    return None if r.passed else f"a trial run failed ({r.reason}): {r.detail or r.stderr.strip()[-300:]}"


def _run_sandboxed(code: str, checks: list[Check], timeout_s: float, memory_bytes: int, max_output_bytes: int,
                   use_namespaces: bool, capture_stdout: bool, filesystem: Filesystem | None,
                   trial: bool = False) -> SandboxResult:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    if memory_bytes < 32 << 20:
        raise ValueError(f"memory_bytes={memory_bytes} is below the 32 MiB an interpreter needs to start")
    if max_output_bytes <= 0:
        raise ValueError(f"max_output_bytes={max_output_bytes} must be > 0")
    if not use_namespaces and filesystem not in (None, "none"):
        raise ValueError(f"filesystem={filesystem!r} needs namespaces; use_namespaces=False runs without")
    if filesystem is not None and not trial:  # a trial run is the probe of its backend
        why = filesystem_unavailable(filesystem)
        if why is not None:
            raise SandboxError(f"filesystem isolation {filesystem!r} does not work here: {why}")
    if not code.strip():
        return SandboxResult(False, "no_code", "", 0.0)
    if not use_namespaces:
        filesystem = "none"
    elif filesystem is None:
        filesystem = filesystem_isolation()

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="disagg-sandbox-") as tmp, \
            (tempfile.TemporaryDirectory(prefix="disagg-sandbox-root-") if filesystem == "namespaces"
             else nullcontext("")) as new_root:
        exprs = json.dumps([c.expr for c in checks])  # the expected values stay here
        for name, text in (("answer.py", code), ("exprs.json", exprs), ("_runner.py", _RUNNER)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
        run = _start(tmp, timeout_s, memory_bytes, max_output_bytes, use_namespaces, capture_stdout, filesystem,
                     new_root)
        reason, detail, stderr = _finish(run, timeout_s, checks)
    stdout = run.stdout_tail.decode("utf-8", "replace") if run.stdout_tail is not None else ""
    return SandboxResult(reason == "passed", reason, detail, time.monotonic() - t0, run.network_isolation,
                         run.process_isolation, stderr, run.proc.pid, stdout, filesystem)


@dataclass
class _Run:
    proc: subprocess.Popen
    results: bytearray
    """The head of what came through the results pipe (``runner``'s lines)."""
    results_reader: threading.Thread
    stderr_tail: bytearray
    reader: threading.Thread
    network_isolation: Literal["netns", "prelude"]
    process_isolation: Literal["pidns", "group"]
    stdout_tail: bytearray | None = None
    stdout_reader: threading.Thread | None = None


def _start(tmp: str, timeout_s: float, memory_bytes: int, max_output_bytes: int, use_namespaces: bool,
           capture_stdout: bool, filesystem: Filesystem, new_root: str) -> _Run:
    results_r, results_w = os.pipe()
    report_r, report_w = os.pipe()
    cpu_s = math.ceil(timeout_s) + 1
    limits = [
        (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),
        (resource.RLIMIT_FSIZE, (_FILE_SIZE_BYTES, _FILE_SIZE_BYTES)),
        (resource.RLIMIT_NOFILE, (_NUM_FILES, _NUM_FILES)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    as_root = os.geteuid() == 0
    drop_uid = NOBODY if as_root and filesystem != "none" else -1  # the runner drops the answer to it
    if drop_uid >= 0:
        os.chown(tmp, NOBODY, NOBODY)
        os.chmod(tmp, 0o711)  # and root in the box, which keeps no DAC override, may enter it
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)  # readable by nobody whatever our umask, writable by root only
    nproc = _nproc_limit(drop_uid)
    if nproc is not None:
        limits.append((resource.RLIMIT_NPROC, (nproc, nproc)))
    limits.append((resource.RLIMIT_AS, (memory_bytes, memory_bytes)))  # last: the forked parent image may exceed it
    env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
    # -u when stdout is captured: what was printed before a timeout kill or os._exit still arrives
    argv = [sandbox_fs.INTERPRETER, "-I", "-S", "-B", *(["-u"] if capture_stdout else []), "_runner.py",
            str(results_w), repr(float(timeout_s)), str(_PID_MAX_IN_NS if _PER_NAMESPACE_PID_MAX else 0),
            str(drop_uid)]
    plan = sandbox_fs.plan_view(tmp, sandbox_fs.python_dirs()) if filesystem != "none" else []
    if filesystem == "bwrap":
        argv = sandbox_fs.bwrap_argv(plan, tmp, as_root=as_root) + argv
    try:
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True, pass_fds=(results_w,),
                                preexec_fn=partial(_preexec, limits, use_namespaces, filesystem, plan, new_root, tmp,
                                                   as_root, report_w))
    except BaseException:
        os.close(results_r)
        os.close(report_r)
        raise
    finally:
        os.close(results_w)
        os.close(report_w)
    report = _read_all(report_r)  # written by _preexec before the exec that Popen waited for
    os.close(report_r)
    if report[:1] == b"!":  # _preexec could not build the filesystem view and exited before the exec
        proc.wait()
        proc.stderr.close()
        if proc.stdout is not None:
            proc.stdout.close()
        os.close(results_r)
        raise SandboxError(f"filesystem isolation {filesystem!r} failed: {report[1:].decode(errors='replace')}")
    tail = bytearray()
    reader = threading.Thread(target=_drain, args=(proc.stderr.fileno(), tail, max_output_bytes), daemon=True,
                              name=f"sandbox-stderr-{proc.pid}")
    reader.start()
    results = bytearray()
    results_reader = threading.Thread(target=_drain_head, args=(results_r, results, _RESULTS_BYTES), daemon=True,
                                      name=f"sandbox-results-{proc.pid}")
    results_reader.start()
    run = _Run(proc, results, results_reader, tail, reader, "netns" if report[:1] == b"n" else "prelude",
               "pidns" if report[1:2] == b"y" else "group")
    if capture_stdout:
        run.stdout_tail = bytearray()
        run.stdout_reader = threading.Thread(target=_drain, args=(proc.stdout.fileno(), run.stdout_tail,
                                                                  max_output_bytes),
                                             daemon=True, name=f"sandbox-stdout-{proc.pid}")
        run.stdout_reader.start()
    return run


def _preexec(limits: list[tuple[int, tuple[int, int]]], use_namespaces: bool, filesystem: Filesystem,
             plan: list[sandbox_fs.Entry], new_root: str, box: str, as_root: bool, report_fd: int) -> None:
    """In the forked child before exec: namespaces (bwrap makes its own), the filesystem view,
    subreaper, then limits. Must not raise: a view it cannot build is reported and it exits."""
    netns = pidns = filesystem == "bwrap"
    err = sandbox_fs.unshare_mounts(as_root=as_root) if filesystem == "namespaces" else None
    if use_namespaces and filesystem != "bwrap" and err is None:
        netns = _LIBC.unshare(_CLONE_NEWNET) == 0
        pidns = _LIBC.unshare(_CLONE_NEWPID) == 0  # applies to the supervisor's child, not the supervisor
    if filesystem == "namespaces" and err is None:
        err = sandbox_fs.enter_view(plan, new_root, box, as_root=as_root, host_proc=as_root and not pidns)
    if err is not None:
        os.write(report_fd, b"!" + err.encode(errors="replace"))
        os._exit(127)
    if filesystem != "bwrap":  # bwrap sets it for the box itself (and may be installed setuid)
        _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binary (sudo, su) raises the answer's rights
    _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.write(report_fd, (b"n" if netns else b"p") + (b"y" if pidns else b"n"))
    for res, lim in limits:
        resource.setrlimit(res, lim)


def _finish(run: _Run, timeout_s: float, checks: list[Check]) -> tuple[Reason, str, str]:
    proc = run.proc
    backstop = False
    try:
        proc.wait(timeout=timeout_s + _GRACE_S)
    except subprocess.TimeoutExpired:
        backstop = True  # the supervisor did not enforce its timer (starved of CPU, or stopped by the answer)
        _kill_children(proc.pid)
        try:
            proc.wait(timeout=0.5)  # let it reap them: killed together, a namespace's init would outlive it
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid)  # the supervisor reaped the run already unless it overran or was killed
    proc.wait()
    _wait_group_gone(proc.pid)
    run.reader.join(timeout=1.0)
    proc.stderr.close()
    if run.stdout_reader is not None:
        run.stdout_reader.join(timeout=1.0)
        proc.stdout.close()
    run.results_reader.join(timeout=1.0)
    values, status = sandbox_checks.parse_results(bytes(run.results), len(checks))

    stderr = run.stderr_tail.decode("utf-8", "replace")
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    detail = lines[-1][:_DETAIL_CHARS] if lines else ""
    code = proc.returncode
    timed_out = backstop or code == _EXIT_TIMEOUT or code == 128 + signal.SIGXCPU
    for i, (check, reported) in enumerate(zip(checks, values)):  # the first test that does not hold decides
        if not reported:
            break  # the child stopped before this test: the run's reason below
        outcome = sandbox_checks.judge_reported(i, check, reported)
        if outcome is not None:
            return outcome[0], outcome[1][:_DETAIL_CHARS], stderr
    else:  # every test held
        if status == "done" and code == 0 and not timed_out:
            return "passed", detail, stderr
    if timed_out:
        return "timeout", detail or f"killed after {timeout_s}s", stderr
    if len(run.results) >= _RESULTS_BYTES:
        return "error", f"more than {_RESULTS_BYTES} bytes of results; the rest were dropped", stderr
    if status in ("failed", "error", "syntax", "memory"):
        return status, detail, stderr
    if code == 128 + signal.SIGKILL or any(h in stderr for h in _MEMORY_HINTS):
        return "memory", detail, stderr  # a SIGKILL that was not our timer's: the OOM killer
    return "error", detail or f"exited with status {code} before the tests finished", stderr


def _kill_children(pid: int) -> None:
    """SIGKILL the children of ``pid`` and their groups (in a PID namespace: its init, and so all of it)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return
    for k in kids:
        try:
            os.kill(k, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_group(k)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_group_gone(pgid: int, timeout_s: float = 2.0) -> None:
    """Processes die asynchronously after SIGKILL; wait until the group is empty."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def _drain(fd: int, tail: bytearray, max_bytes: int) -> None:
    """Read ``fd`` to EOF keeping only the last ``max_bytes``, so a flood costs no memory."""
    dropped = 0
    while chunk := os.read(fd, 1 << 16):
        tail += chunk
        if len(tail) > 2 * max_bytes:
            dropped += len(tail) - max_bytes
            del tail[:-max_bytes]
    if len(tail) > max_bytes:
        dropped += len(tail) - max_bytes
        del tail[:-max_bytes]
    if dropped:
        tail[:0] = b"[... %d bytes truncated]\n" % dropped


def _drain_head(fd: int, head: bytearray, max_bytes: int) -> None:
    """Read ``fd`` to EOF keeping only the first ``max_bytes``, then close it (only this thread reads it)."""
    try:
        while chunk := os.read(fd, 1 << 16):
            if len(head) < max_bytes:
                head += chunk[:max_bytes - len(head)]
    finally:
        os.close(fd)


def _read_all(fd: int, limit: int = 1 << 16) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    try:
        while len(out) < limit and (chunk := os.read(fd, limit)):
            out += chunk
    except BlockingIOError:
        pass  # a straggler still holds the write end; what is there is all we take
    return out


def _nproc_limit(drop_uid: int) -> int | None:
    """RLIMIT_NPROC for the child: the threads of the user the answer runs as (``drop_uid``, else
    ours) now plus a margin; None as root when the answer runs as root (exempt)."""
    if os.geteuid() == 0 and drop_uid < 0:
        return None
    uid, num_threads = (drop_uid if drop_uid >= 0 else os.getuid()), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # exited while we were scanning
        if int(fields["Uid"].split()[0]) == uid:
            num_threads += int(fields["Threads"])
    return num_threads + _NPROC_MARGIN


def _per_namespace_pid_max() -> bool:
    """Whether ``/proc/sys/kernel/pid_max`` is per PID namespace (Linux >= 6.14).

    On older kernels it is global: writing it from the sandbox would cap the whole machine.
    """
    parts = platform.release().split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (6, 14)
    except (IndexError, ValueError):
        return False


_PER_NAMESPACE_PID_MAX = _per_namespace_pid_max()


# The supervisor script the interpreter runs (a file of its own; never imported).
_RUNNER = (Path(__file__).parent / "runner.py").read_text(encoding="utf-8")
