"""The script the sandbox's interpreter runs (``disagg.tasks.sandbox`` copies it into the run's
directory as ``_runner.py``); never imported.

It is the supervisor: it forks the child that runs the answer then the tests, and never runs
user code itself. Standard library only (``python -I -S``); its arguments are the nonce and
status pipes, the timeout, the PID namespace's pid_max (0: leave it) and the uid the answer
drops to (-1: none).
"""

import os
import signal
import sys
import time

NONCE_FD, STATUS_FD, TIMEOUT_S, PID_MAX, DROP_UID = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                                     int(sys.argv[4]), int(sys.argv[5]))
EXIT_TIMEOUT = 124


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


def report(nonce, verdict):
    os.write(STATUS_FD, nonce + b" " + verdict + b"\n")


def fail(nonce, verdict, exc):
    if isinstance(exc, MemoryError):
        os.write(2, b"MemoryError\n")  # no traceback: formatting one needs memory
        report(nonce, b"memory")
    else:
        import traceback
        traceback.print_exception(exc)
        sys.stderr.flush()
        report(nonce, verdict)
    os._exit(0)


def run_child(nonce):
    os.nice(10)  # below the supervisor, so its timer still runs promptly when the answer saturates the CPUs
    if os.getpid() == 1:  # init of our own PID namespace
        os.setpgid(0, 0)  # out of the supervisor's group: nothing in the namespace can then signal it
        if PID_MAX:  # the parent checked that this kernel scopes pid_max to the namespace
            try:
                with open("/proc/sys/kernel/pid_max", "w") as f:
                    f.write(str(PID_MAX))
            except OSError:
                pass  # /proc/sys mounted read-only (containers): the timeout alone bounds a fork bomb
    if DROP_UID >= 0:  # root in the box: the answer runs as nobody; raises (no verdict) if it cannot
        os.setgroups([])
        os.setresgid(DROP_UID, DROP_UID, DROP_UID)
        os.setresuid(DROP_UID, DROP_UID, DROP_UID)
    deny_network()
    with open("answer.py", encoding="utf-8", errors="surrogatepass") as f:
        answer_src = f.read()
    with open("tests.py", encoding="utf-8") as f:
        tests_code = compile(f.read(), "tests.py", "exec")
    try:
        answer_code = compile(answer_src, "answer.py", "exec")
    except (SyntaxError, ValueError) as e:
        fail(nonce, b"syntax", e)
    namespace = {"__name__": "answer", "__builtins__": __builtins__}
    try:
        exec(answer_code, namespace)  # noqa: S102 - running the answer is this script's purpose
    except BaseException as e:  # noqa: BLE001 - whatever the answer raises is its verdict
        fail(nonce, b"error", e)
    try:
        exec(tests_code, namespace)  # noqa: S102
    except AssertionError as e:
        fail(nonce, b"failed", e)
    except BaseException as e:  # noqa: BLE001
        fail(nonce, b"error", e)
    report(nonce, b"passed")
    os._exit(0)


def main():
    nonce = os.read(NONCE_FD, 64)
    os.close(NONCE_FD)
    child = os.fork()
    if child == 0:
        run_child(nonce)
    os.close(STATUS_FD)
    supervise(child)


if __name__ == "__main__":
    main()
