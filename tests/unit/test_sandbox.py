"""The code sandbox and the code_tests reward, with real subprocesses (no mocks).

Each case runs a real interpreter; the slow ones (timeout, fork bomb, leftover
processes) are bounded by the sandbox's own timeout.
"""

import os
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from disagg.tasks.base import get_reward
from disagg.tasks.code import code_tests_reward, extract_code, make_code_rows, reason_counts
from disagg.tasks.sandbox import run_python

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
    ("def add(a, b):\n    return a - b\n", "failed", "AssertionError"),
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


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_processes_left_behind_are_killed(tmp_path, use_namespaces):
    """A daemon that leaves the session would write the marker if it outlived the run."""
    marker = tmp_path / "survived"
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    time.sleep(0.5)\n"
            f"    open({str(marker)!r}, 'w').close()\n"
            "    os._exit(0)\n" + ADD)
    r = run_python(code, ADD_TESTS, use_namespaces=use_namespaces)
    assert r.passed
    _assert_nothing_left(r)
    time.sleep(1.0)
    assert not marker.exists()


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
