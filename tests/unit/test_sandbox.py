"""The code sandbox and the code_tests reward, with real subprocesses (no mocks).

Each case runs a real interpreter; the slow ones (timeout, fork bomb, leftover
processes) are bounded by the sandbox's own timeout.
"""

import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from disagg.errors import SandboxError
from disagg.sandbox import fs as sandbox_fs, run as sandbox
from disagg.tasks import get_reward
from disagg.tasks.code import code_tests_reward, extract_code, make_code_rows, reason_counts
from disagg.sandbox import run_python

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
ADD = "def add(a, b):\n    return a + b\n"


def _session_members(sid):
    """Pids (zombies included) whose session is ``sid``: every process of a run unless it called setsid()."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                pids.append(int(name))
    return pids


def _assert_nothing_left(r):
    with pytest.raises(ProcessLookupError):
        os.killpg(r.pgid, 0)
    assert _session_members(r.pgid) == []


@pytest.fixture(scope="module")
def isolation():
    r = run_python(ADD, ADD_TESTS)
    return r.network_isolation, r.process_isolation


def test_correct_answer_passes_and_records_isolation():
    r = run_python(ADD, ADD_TESTS)
    assert (r.passed, r.reason) == (True, "passed")
    assert r.network_isolation in ("netns", "prelude") and r.process_isolation in ("pidns", "group")
    if os.geteuid() == 0:  # namespaces need CAP_SYS_ADMIN, which root has on this machine
        assert (r.network_isolation, r.process_isolation) == ("netns", "pidns")


@pytest.mark.parametrize("code, reason, detail", [
    ("def add(a, b):\n    return a - b\n", "failed", "AssertionError: assert add(2, 3) == 5 (add(2, 3) was -1)"),
    ("def add(a, b):\n    return a / 0\n", "error", "ZeroDivisionError: division by zero"),
    ("def add(a, b)\n    return a + b\n", "syntax", "SyntaxError: expected ':'"),
    ("import sys\nsys.exit(0)\n", "error", "SystemExit: 0"),
    ("import os\nos._exit(0)\n", "error", "exited with status 0 before the tests finished"),
    ("   \n", "no_code", ""),
])
def test_failing_answers_score_with_their_reason(code, reason, detail):
    r = run_python(code, ADD_TESTS)
    assert (r.passed, r.reason, r.detail) == (False, reason, detail)


def test_misuse_raises():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python(ADD, ADD_TESTS, timeout_s=0)
    with pytest.raises(ValueError, match="tests do not compile"):
        run_python(ADD, "assert add(2, 3) ==\n")


def test_infinite_loop_is_killed_at_the_timeout():
    r = run_python("while True:\n    pass\n", ADD_TESTS, timeout_s=1.0)
    assert (r.passed, r.reason) == (False, "timeout")
    assert 1.0 <= r.seconds < 2.0
    _assert_nothing_left(r)


def test_memory_limit():
    ok = run_python("buf = bytearray(100 << 20)\n" + ADD, ADD_TESTS, memory_bytes=256 << 20)
    assert ok.passed  # the limit leaves room for real work
    r = run_python("buf = bytearray(2 << 30)\n" + ADD, ADD_TESTS, memory_bytes=256 << 20)
    assert (r.passed, r.reason, r.detail) == (False, "memory", "MemoryError")


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_answer_cannot_connect_to_a_local_listener(use_namespaces):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n" + ADD
        r = run_python(code, ADD_TESTS, use_namespaces=use_namespaces)
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    assert (r.passed, r.reason) == (False, "error")
    assert r.detail.startswith(("PermissionError", "OSError", "ConnectionRefusedError"))


def test_network_namespace_blocks_raw_syscalls(isolation):
    """The prelude only patches Python's socket module; the namespace also stops a libc connect()."""
    if isolation[0] != "netns":
        pytest.skip("network namespaces are not permitted here")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            "import ctypes, struct\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "fd = libc.socket(2, 1, 0)\n"  # AF_INET, SOCK_STREAM
            f"addr = struct.pack('!HH4s8x', 2, {port}, bytes([127, 0, 0, 1]))\n"
            "addr = struct.pack('=H', 2) + addr[2:]\n"  # sin_family is host byte order
            "rc = libc.connect(fd, addr, len(addr))\n"
        )
        r = run_python(code, "assert rc == -1, rc\n")
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    assert r.passed, r.stderr


def test_files_land_in_a_temp_dir_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = ("import os, sys\nopen('out.txt', 'w').write('x')\n"
            "sys.stderr.write(os.path.abspath('out.txt') + '\\n')\n" + ADD)
    r = run_python(code, ADD_TESTS)
    assert r.passed
    written = r.stderr.strip().splitlines()[-1]
    sandbox_dir = os.path.dirname(written)
    assert os.path.basename(sandbox_dir).startswith("disagg-sandbox-")
    assert os.path.dirname(sandbox_dir) == tempfile.gettempdir()
    assert not os.path.exists(sandbox_dir)
    assert list(tmp_path.iterdir()) == []


def _processes_with_argv(argv):
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[:-1] == argv:
                        found.append(int(name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_processes_left_behind_are_killed(use_namespaces):
    """A daemon that leaves the session and execs a sleep of a unique length would still be
    found by that command line after the run (the box shows the caller nothing to write to)."""
    seconds = f"9.{secrets.randbelow(10**6):06d}"
    code = ("import os\n"
            "r, w = os.pipe()\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    os.write(w, b'x')\n"
            f"    os.execv('/bin/sleep', ['sleep', {seconds!r}])\n"
            "assert os.read(r, 1) == b'x'\n" + ADD)
    r = run_python(code, ADD_TESTS, use_namespaces=use_namespaces)
    assert r.passed, r.stderr
    _assert_nothing_left(r)
    time.sleep(0.5)  # a survivor has exec'd by now
    assert _processes_with_argv([b"sleep", seconds.encode()]) == []


def test_fork_bomb_is_contained(isolation):
    if isolation[1] != "pidns" and os.geteuid() == 0:
        pytest.skip("as root without a PID namespace only the timeout bounds a fork bomb; not run here")
    r = run_python("import os\nwhile True:\n    os.fork()\n", ADD_TESTS, timeout_s=2.0)
    assert not r.passed
    assert r.reason in ("timeout", "error")  # killed, or the bomb's root hit the process cap and raised
    assert r.seconds < 6.0
    _assert_nothing_left(r)
    assert subprocess.run(["true"], timeout=5).returncode == 0
    assert run_python(ADD, ADD_TESTS).passed


def test_output_flood_is_truncated():
    code = "import sys\nfor _ in range(20000):\n    sys.stderr.write('y' * 99 + '\\n')\n" + ADD
    r = run_python(code, ADD_TESTS, max_output_bytes=4096)
    assert r.passed
    assert r.stderr.startswith("[... ") and len(r.stderr) < 4096 + 64
    assert r.stderr.rstrip().endswith("y" * 99)


@pytest.mark.parametrize("response, code", [
    ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
    ("```py\nx = 1\n```\nthen\n```python\nx = 2\n```", "x = 2\n"),
    ("```\nx = 3\n```", "x = 3\n"),
    ("```python\nx = 4\n", "x = 4\n"),
    ("```bash\nls\n```", "```bash\nls\n```"),
    ("def g():\n    return 2\n", "def g():\n    return 2\n"),
])
def test_extract_code(response, code):
    assert extract_code(response) == code


def test_reward_scores_and_counts_reasons():
    assert get_reward("code_tests", None) is code_tests_reward
    row = {"prompt": "Write add.", "tests": ADD_TESTS}
    reason_counts(reset=True)
    responses = [f"```python\n{ADD}```", "```python\ndef add(a, b):\n    return 0\n```",
                 "def add(a, b):\n    return a + b\n", "no code here, sorry"]
    scores = [0.0] * 8

    def score(i):
        scores[i] = code_tests_reward(responses[i % 4], row)

    threads = [threading.Thread(target=score, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert scores == [1.0, 0.0, 1.0, 0.0] * 2
    assert reason_counts(reset=True) == {"passed": 4, "failed": 2, "syntax": 2}
    assert reason_counts() == {}


REFERENCE = {
    "add(a, b)": "def add(a, b):\n    return a + b\n",
    "max_of_list(xs)": "def max_of_list(xs):\n    return max(xs)\n",
    "reverse_string(s)": "def reverse_string(s):\n    return s[::-1]\n",
    "is_even(n)": "def is_even(n):\n    return n % 2 == 0\n",
    "factorial(n)": "import math\ndef factorial(n):\n    return math.factorial(n)\n",
}


def test_code_rows_are_seeded_and_solvable():
    rows = make_code_rows(40, seed=3)
    assert rows == make_code_rows(40, seed=3) and rows != make_code_rows(40, seed=4)
    by_template = {}
    for row in rows:
        (sig,) = [s for s in REFERENCE if s in row["prompt"]]
        by_template.setdefault(sig, row)
    assert set(by_template) == set(REFERENCE)
    for sig, row in by_template.items():
        assert code_tests_reward(f"```python\n{REFERENCE[sig]}```", row) == 1.0, (sig, row)
        assert code_tests_reward("```python\ndef unrelated():\n    pass\n```", row) == 0.0


def test_code_task_source_streams_seeded_solvable_rows_and_needs_the_code_reward(tmp_path):
    from itertools import islice

    from disagg.config import ConfigError, load_config
    from disagg.tasks.code import CodeTaskSource, code_tests_reward

    rows = list(islice(CodeTaskSource(seed=3), 12))
    assert [r.prompt for r in rows] == [r.prompt for r in islice(CodeTaskSource(seed=3), 12)]
    assert len({r.prompt for r in rows}) > 1 and [r.index for r in rows] == list(range(12))
    solutions = {"add(": "def add(a, b):\n    return a + b\n",
                 "max_of_list": "def max_of_list(xs):\n    return max(xs)\n",
                 "reverse_string": "def reverse_string(s):\n    return s[::-1]\n",
                 "is_even": "def is_even(n):\n    return n % 2 == 0\n",
                 "factorial": "import math\ndef factorial(n):\n    return math.factorial(n)\n"}
    for r in rows[:5]:
        code = next(v for k, v in solutions.items() if k in r.prompt)
        assert code_tests_reward(f"```python\n{code}```", r.row) == 1.0
        assert code_tests_reward("```python\ndef nothing(): pass\n```", r.row) == 0.0
    with pytest.raises(ConfigError, match="reward.name=code_tests"):
        load_config({"data": {"task": "code"}})
    assert load_config({"data": {"task": "code"}, "reward": {"name": "code_tests"}}).data.task == "code"


# ---- filesystem isolation -----------------------------------------------------------------

PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["bwrap", "namespaces"])
def fs_backend(request):
    """Each backend; skipped only where this machine cannot run it (as root it must, bwrap where installed)."""
    why = sandbox.filesystem_unavailable(request.param)
    if why is not None:
        must = os.geteuid() == 0 and (request.param == "namespaces" or sandbox_fs.BWRAP is not None)
        (pytest.fail if must else pytest.skip)(f"{request.param} filesystem isolation: {why}")
    return request.param


@pytest.fixture
def planted(tmp_path):
    """Files the box must neither read nor change: world-readable and world-writable, in a
    world-writable directory under the caller's /tmp (so only the box's view hides them, not
    its user), a fake run directory with its control token, and a file in $HOME."""
    outside = Path(tempfile.mkdtemp(prefix="disagg-test-outside-"))
    home_secret = Path.home() / f".disagg-sandbox-test-{secrets.token_hex(4)}"
    try:
        outside.chmod(0o777)
        (outside / "run").mkdir(mode=0o755)
        files = {"secret": outside / "secret.txt", "token": outside / "run" / "control.token",
                 "tmp_path": tmp_path / "planted.txt"}
        if os.access(Path.home(), os.W_OK):
            files["home"] = home_secret
        for f in files.values():
            f.write_text("s3cret\n")
            f.chmod(0o666)
        yield outside, files
    finally:
        shutil.rmtree(outside)
        home_secret.unlink(missing_ok=True)


def _box_report(probes, **kw):
    """Run ``probes`` (name -> (op, path)) in the box; name -> "ok" or the exception's type."""
    code = f"""import json, os
def attempt(op, path):
    try:
        if op == "read":
            open(path).read()
        elif op == "append":
            open(path, "a").write("hacked")
        else:
            open(path, "w").write("x")
            assert open(path).read() == "x"
        return "ok"
    except Exception as e:
        return type(e).__name__
print(json.dumps({{name: attempt(op, path) for name, (op, path) in {probes!r}.items()}} | {{"uid": os.getuid()}}))
"""
    r = sandbox.run_snippet(code, **kw)
    assert r.passed, r.stderr
    return r, json.loads(r.stdout)


def test_box_hides_the_job_and_keeps_writes_inside(fs_backend, planted):
    outside, files = planted
    new_home = Path.home() / f".disagg-sandbox-test-{secrets.token_hex(4)}"
    probes = {
        "read secret": ("read", str(files["secret"])),
        "read control token": ("read", str(files["token"])),
        "read tmp_path": ("read", str(files["tmp_path"])),
        "read project": ("read", str(PROJECT / "pyproject.toml")),
        "append secret": ("append", str(files["secret"])),
        "append tmp_path": ("append", str(files["tmp_path"])),
        "create outside": ("write", str(outside / "new.txt")),
        "create in project": ("write", str(PROJECT / "sandbox-was-here.txt")),
        "create in home": ("write", str(new_home)),
        **({"read home": ("read", str(files["home"]))} if "home" in files else {}),
        "create in etc": ("write", "/etc/sandbox-was-here"),
        "create in cwd": ("write", "inside.txt"),
        "create in tmp": ("write", "/tmp/inside.txt"),
        "create in shm": ("write", "/dev/shm/inside.txt"),
        "append the tests' expressions": ("append", "exprs.json"),
    }
    try:
        r, got = _box_report(probes, filesystem=fs_backend)
    finally:
        new_home.unlink(missing_ok=True)
    assert r.filesystem_isolation == fs_backend
    hidden = {k: "FileNotFoundError" for k in probes if k.startswith(("read", "append secret", "append tmp_path"))}
    assert {k: got[k] for k in hidden} == hidden  # not merely denied: not there at all
    for k in ("create outside", "create in project", "create in home", "create in etc"):
        assert got[k] in ("FileNotFoundError", "PermissionError", "OSError"), k  # OSError: read-only file system
    assert (got["create in cwd"], got["create in tmp"], got["create in shm"]) == ("ok", "ok", "ok")
    if os.geteuid() == 0:  # the answer runs as nobody: a root-owned file is not writable even in its own directory
        assert (got["uid"], got["append the tests' expressions"]) == (sandbox_fs.NOBODY, "PermissionError")
    for f in files.values():
        assert f.read_text() == "s3cret\n"
    assert sorted(p.name for p in outside.iterdir()) == ["run", "secret.txt"]
    assert not (PROJECT / "sandbox-was-here.txt").exists() and not new_home.exists()


def test_without_isolation_the_box_sees_the_host(planted):
    """The control for the test above: the same probe reads the planted file when nothing isolates."""
    _, files = planted
    r, got = _box_report({"read secret": ("read", str(files["secret"]))}, use_namespaces=False)
    assert (r.filesystem_isolation, got["read secret"]) == ("none", "ok")


def test_this_machine_isolates_the_filesystem():
    r = run_python(ADD, ADD_TESTS)
    assert r.passed and r.filesystem_isolation == sandbox.filesystem_isolation()
    if os.geteuid() != 0:
        pytest.skip("as another user what works depends on the machine's user namespaces")
    if shutil.which("apt-get"):
        assert sandbox_fs.BWRAP, "run `make venv`: as root where apt-get is there it installs bubblewrap"
    assert r.filesystem_isolation == ("bwrap" if sandbox_fs.BWRAP else "namespaces")
    assert sandbox.require_filesystem_isolation() == r.filesystem_isolation


def test_no_isolation_is_logged_once_and_an_error_when_required(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_probes", {"none": None, "bwrap": "bwrap is not installed",
                                             "namespaces": "unshare: Operation not permitted"})
    monkeypatch.setattr(sandbox, "_default_filesystem", None)
    with caplog.at_level(logging.INFO, logger="disagg.sandbox"):
        assert run_python(ADD, ADD_TESTS).filesystem_isolation == "none"
        assert run_python(ADD, ADD_TESTS).passed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NO filesystem isolation" in warnings[0] and "Operation not permitted" in warnings[0]
    with pytest.raises(SandboxError, match="bwrap: bwrap is not installed; namespaces: unshare: Operation not "
                                           "permitted.*reward.require_sandbox_isolation"):
        sandbox.require_filesystem_isolation()
    with pytest.raises(SandboxError, match="'bwrap' does not work here: bwrap is not installed"):
        run_python(ADD, ADD_TESTS, filesystem="bwrap")
    with pytest.raises(ValueError, match="use_namespaces=False"):
        run_python(ADD, ADD_TESTS, filesystem="namespaces", use_namespaces=False)

    from disagg.pipeline import RewardWorker

    monkeypatch.setattr("disagg.logs.setup_logging", lambda role, level, actor=False: None)
    with pytest.raises(SandboxError, match="cannot isolate the filesystem"):  # reward.require_sandbox_isolation
        RewardWorker("code_tests", None, 0.0, "INFO", require_sandbox_isolation=True)


def test_a_view_that_cannot_be_built_raises(monkeypatch):
    if sandbox.filesystem_unavailable("namespaces") is not None:
        pytest.skip(f"namespaces filesystem isolation: {sandbox.filesystem_unavailable('namespaces')}")
    real = sandbox_fs.plan_view
    monkeypatch.setattr(sandbox_fs, "plan_view",
                        lambda box, pythons: real(box, pythons) + [("ro", "/nonexistent-disagg", "/x")])
    with pytest.raises(SandboxError, match="'namespaces' failed: ro /nonexistent-disagg /x: No such file"):
        run_python(ADD, ADD_TESTS, filesystem="namespaces")


def test_plan_and_bwrap_command_line(tmp_path):
    usr, bin_, lib32 = tmp_path / "usr", tmp_path / "bin", tmp_path / "lib32"
    (usr / "lib" / "python3").mkdir(parents=True)
    bin_.symlink_to("usr/bin")
    box = "/tmp/disagg-sandbox-abc"
    plan = sandbox_fs.plan_view(box, ["/opt/py/3.11", str(usr / "lib" / "python3")],
                                system=(str(usr), str(bin_), str(lib32)))
    assert plan == [("ro", str(usr), str(usr)), ("symlink", "usr/bin", str(bin_)), ("tmpfs", "", "/tmp"),
                    ("tmpfs", "", "/dev/shm"), ("dir", "", "/opt"), ("dir", "", "/opt/py"), ("ro", "/opt/py/3.11", "/opt/py/3.11"),
                    ("rw", box, box)]
    as_root = " ".join(sandbox_fs.bwrap_argv(plan, box, as_root=True))
    for part in (f"--ro-bind {usr} {usr}", f"--symlink usr/bin {bin_}",
                 "--perms 0755 --dir /opt --perms 0755 --dir /opt/py --ro-bind /opt/py/3.11 /opt/py/3.11",
                 "--perms 1777 --tmpfs /tmp", f"--bind {box} {box} --remount-ro / --chdir {box} --",
                 "--unshare-net --unshare-pid --as-pid-1",
                 "--cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID --cap-add CAP_KILL"):
        assert part in as_root
    assert "--unshare-user" not in as_root  # as root a user namespace would map the box's nobody to root
    as_user = " ".join(sandbox_fs.bwrap_argv(plan, box, as_root=False))
    assert "--unshare-user" in as_user and "--cap-" not in as_user
