"""The script the sandbox's interpreter runs (``disagg.sandbox`` copies it into the run's
directory as ``_runner.py``); never imported.

It is the supervisor: it forks the child that runs the answer then evaluates the tests'
expressions (``exprs.json``, from ``disagg.sandbox.checks``), and never runs user code
itself. The child writes to the results pipe one line per expression, ``value <i> <json>``
(``encode``) or ``refused <i> <why>``, and ``status <word>`` when it stops: done, syntax, error,
failed (an AssertionError) or memory. The answer runs in the child and may write there too;
the caller only trusts what it can check (the expected values are not in the box).
Standard library only (``python -I -S``); its arguments are the results pipe, the timeout,
the PID namespace's pid_max (0: leave it) and the uid the answer drops to (-1: none).
"""

import json
import os
import signal
import sys
import time

RESULTS_FD, TIMEOUT_S, PID_MAX, DROP_UID = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
EXIT_TIMEOUT = 124
MAX_DEPTH = 100  # checks.MAX_DEPTH


def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap_all():
    # Kill and reap every child until none is left. As subreaper we inherit the
    # orphans of each process we kill, so this walks the whole tree top-down,
    # setsid() escapees included.
    me = os.getpid()
    while True:
        try:
            with open(f"/proc/{me}/task/{me}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        for k in kids:
            kill(k)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        time.sleep(0.005)


def supervise(child):
    timed_out = []

    def on_alarm(signum, frame):
        timed_out.append(True)
        kill(child)  # in a PID namespace the kernel then kills everything else in it

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    _, status = os.waitpid(child, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    reap_all()
    if timed_out:
        os._exit(EXIT_TIMEOUT)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else min(code, EXIT_TIMEOUT - 1))


def deny_network():
    import _socket
    import socket

    def denied(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    class NoSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            denied()

    for mod in (socket, _socket):
        for name in ("socket", "SocketType"):
            setattr(mod, name, NoSocket)
        for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
                     "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
            if hasattr(mod, name):
                setattr(mod, name, denied)


class NotData(Exception):
    pass


_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "z"}


def encode(value, depth=0):
    """``value`` as JSON-able data that ``checks.decode`` rebuilds. Types are checked
    exactly (``type(x) is int``): a subclass could forge ``__eq__``, ``__repr__`` or ``__iter__``."""
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return ["i", hex(value)]  # not decimal: hex is exempt from the int-to-str digit limit
    if t is float:
        return ["f", value.hex()]  # exact, and inf and nan too
    if t is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    if t is bytes:
        return ["y", value.hex()]
    if depth >= MAX_DEPTH and t in (list, tuple, set, frozenset, dict):
        raise NotData(f"nested deeper than {MAX_DEPTH}")
    if t in _TAGS:
        return [_TAGS[t], [encode(x, depth + 1) for x in value]]
    if t is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise NotData(f"of type {t.__module__}.{t.__qualname__}, not data (None, bool, int, float, complex, str, bytes, "
                  "list, tuple, set, frozenset, dict)")


def write(data):
    while data:
        data = data[os.write(RESULTS_FD, data):]


def stop(word):
    write(b"status " + word + b"\n")
    os._exit(0)


def fail(word, exc):
    if isinstance(exc, MemoryError):
        os.write(2, b"MemoryError\n")  # no traceback: formatting one needs memory
        stop(b"memory")
    import traceback
    traceback.print_exception(exc)
    sys.stderr.flush()
    stop(word)


def run_child():
    os.nice(10)  # below the supervisor, so its timer still runs promptly when the answer saturates the CPUs
    if os.getpid() == 1:  # init of our own PID namespace
        os.setpgid(0, 0)  # out of the supervisor's group: nothing in the namespace can then signal it
        if PID_MAX:  # the parent checked that this kernel scopes pid_max to the namespace
            try:
                with open("/proc/sys/kernel/pid_max", "w") as f:
                    f.write(str(PID_MAX))
            except OSError:
                pass  # /proc/sys mounted read-only (containers): the timeout alone bounds a fork bomb
    if DROP_UID >= 0:  # root in the box: the answer runs as nobody; raises (no status) if it cannot
        os.setgroups([])
        os.setresgid(DROP_UID, DROP_UID, DROP_UID)
        os.setresuid(DROP_UID, DROP_UID, DROP_UID)
    deny_network()
    with open("answer.py", encoding="utf-8", errors="surrogatepass") as f:
        answer_src = f.read()
    with open("exprs.json", encoding="utf-8") as f:
        exprs = [compile(e, f"test {i + 1}", "eval") for i, e in enumerate(json.load(f))]
    try:
        answer_code = compile(answer_src, "answer.py", "exec")
    except (SyntaxError, ValueError) as e:
        fail(b"syntax", e)
    namespace = {"__name__": "answer", "__builtins__": __builtins__}
    try:
        exec(answer_code, namespace)  # noqa: S102 - running the answer is this script's purpose
    except BaseException as e:  # noqa: BLE001 - whatever the answer raises is its verdict
        fail(b"error", e)
    for i, expr in enumerate(exprs):
        try:
            value = eval(expr, namespace)
        except AssertionError as e:
            fail(b"failed", e)
        except BaseException as e:  # noqa: BLE001
            fail(b"error", e)
        try:
            line = b"value %d %s\n" % (i, json.dumps(encode(value)).encode("ascii"))
        except NotData as e:
            line = b"refused %d %s\n" % (i, str(e).replace("\n", " ").encode("ascii", "backslashreplace"))
        except MemoryError as e:
            fail(b"memory", e)
        write(line)
    stop(b"done")


def main():
    child = os.fork()
    if child == 0:
        run_child()
    os.close(RESULTS_FD)
    supervise(child)


if __name__ == "__main__":
    main()
