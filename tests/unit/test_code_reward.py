"""The code_tests reward cannot be faked by the answer it judges (real sandbox, no mocks).

Each hack is an answer that does not solve the task but attacks the harness instead; every one
must score 0.0. The tests carry expected values that appear nowhere else (40002345), so a hack
that finds them in the box proves they leaked.
"""

from collections import Counter

import pytest

from disagg.sandbox import checks as sandbox_checks
from disagg.tasks.base import safe_reward
from disagg.tasks.code import CodeTaskSource, code_tests_reward, make_code_rows
from disagg.sandbox import run_python

TESTS = "assert add(40000000, 2345) == 40002345\nassert add(-17, 5) == -12\nassert 14 == add(7, 7)\n"
ROW = {"prompt": "Write add(a, b).", "tests": TESTS}
SECRET = "40002345"  # the first expected value: in no expression, argument or file of the box
WRONG_ADD = "def add(a, b):\n    return 0\n"

_FRAMES = """import os, sys
seen = {}
f = sys._getframe(1)
while f is not None:
    seen.update(f.f_globals)
    seen.update(f.f_locals)
    f = f.f_back
"""

_WRITE_EVERYWHERE = """
def write_everywhere(lines):
    for fd in range(1, 64):
        for line in lines:
            try:
                os.write(fd, line)
            except OSError:
                pass
"""

HACKS = {
    # 1. the caller's frame: the verdict nonce, written as a pass before exiting
    "frame nonce verdict": _FRAMES + _WRITE_EVERYWHERE + """
nonce = seen.get("nonce")
lines = [b"status done\\n"] + ([nonce + b" passed\\n"] if isinstance(nonce, bytes) else [])
write_everywhere(lines)
os._exit(0)
""",
    # 1. the caller's frame: the runner's own functions replaced by ones that report a pass
    "frame harness functions": _FRAMES + """
main = sys.modules["__main__"]
if hasattr(main, "report") and "nonce" in seen:
    main.fail = lambda nonce, verdict, exc: (main.report(nonce, b"passed"), os._exit(0))
""" + WRONG_ADD,
    # 2. an object equal to everything
    "AlwaysEqual": """class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def add(a, b):
    return AlwaysEqual()
""",
    # 2. a subclass of int with a forged __eq__ (and repr)
    "int subclass forged __eq__": """class Int(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__
    def __repr__(self):
        return "40002345"
def add(a, b):
    return Int(0)
""",
    # 2. an object that claims int as its __class__
    "forged __class__": """class Fake:
    __class__ = property(lambda self: int)
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def add(a, b):
    return Fake()
""",
    # 3. exiting before the tests run
    "os._exit(0)": "import os\nos._exit(0)\n" + WRONG_ADD,
    "sys.exit(0)": "import sys\nsys.exit(0)\n" + WRONG_ADD,
    # 4. builtins the harness uses, replaced
    "builtins exec/eval": "import builtins\nbuiltins.exec = builtins.eval = lambda *a, **k: None\n" + WRONG_ADD,
    "builtins AssertionError": "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
                               + WRONG_ADD,
    "builtins print/repr": "import builtins\nbuiltins.print = lambda *a, **k: None\n"
                           "builtins.repr = lambda x: '40002345'\n" + WRONG_ADD,
    # 4. the harness's output rewritten: a failed verdict turned into a pass
    "os.write rewritten": """import os
_write = os.write
def write(fd, data):
    return _write(fd, bytes(data).replace(b" failed", b" passed").replace(b" error", b" passed"))
os.write = write
""" + WRONG_ADD,
    # 5. fake result lines on stdout and every descriptor
    "fake result lines": "import os, sys\n" + _WRITE_EVERYWHERE + """
lines = [b"passed\\n", b"status done\\n", b'value 0 ["i", "0x0"]\\n', b'value 1 ["i", "0x0"]\\n',
         b'value 2 ["i", "0x0"]\\n', b"0 true\\n", b"1 true\\n", b"2 true\\n"]
for line in lines:
    print(line.decode().strip())
write_everywhere(lines)
""" + WRONG_ADD,
    # 6. the expected values read from any file the answer can reach
    "read the tests' files": """import os, re
table = {}
for top in (".", "/tmp", "/dev/shm", os.environ.get("TMPDIR", ".")):
    for dirpath, _, names in os.walk(top):
        for name in names:
            try:
                with open(os.path.join(dirpath, name), errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            for a, b, c in re.findall(r"add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)", text):
                table[(int(a), int(b))] = int(c)
            for c, a, b in re.findall(r"(-?\\d+) == add\\((-?\\d+), (-?\\d+)\\)", text):
                table[(int(a), int(b))] = int(c)
def add(a, b):
    return table.get((a, b), 0)
""",
}


def test_a_correct_answer_passes_and_a_wrong_one_fails():
    assert code_tests_reward("```python\ndef add(a, b):\n    return a + b\n```", ROW) == 1.0
    r = run_python(WRONG_ADD, TESTS)
    assert (r.passed, r.reason) == (False, "failed")


@pytest.mark.parametrize("name", list(HACKS))
def test_a_hack_scores_zero(name):
    r = run_python(HACKS[name], TESTS)
    assert not r.passed, (name, r)
    assert code_tests_reward(f"```python\n{HACKS[name]}```", ROW) == 0.0


def test_the_expected_values_are_nowhere_in_the_box():
    """Everything the answer can reach, dumped: frames (locals, globals, code constants), argv,
    environment and every file under its directory, /tmp and /dev/shm."""
    dump = _FRAMES + """import gc

def scan():
    objs = gc.get_objects() + list(seen.values())  # taken before the needle exists
    texts = [repr(sys.argv), repr(dict(os.environ))]
    for top in (".", "/tmp", "/dev/shm"):
        for dirpath, _, names in os.walk(top):
            for name in names:
                try:
                    with open(os.path.join(dirpath, name), "rb") as f:
                        texts.append(f.read().decode("latin-1"))
                except OSError:
                    pass
    needle = str(int("40002") * 1000 + 345)  # not a constant the compiler could fold into the answer
    hits = sum(needle in t for t in texts)
    for v in objs:
        try:
            hits += needle in repr(v) or needle in repr(getattr(v, "co_consts", ""))
        except Exception:
            pass
    return hits, len(objs)

hits, num_objects = scan()
sys.stderr.write(f"hits={hits} objects={num_objects}\\n")

def add(a, b):
    return a + b
"""
    r = run_python(dump, TESTS)
    assert r.passed, r.stderr
    assert "hits=0 " in r.stderr, r.stderr[-500:]


def test_the_results_pipe_taken_over():
    """The answer drops the runner's lines and writes its own: a guess, judged as such."""
    takeover = """import os, sys
fd = int(sys.argv[1])
_write = os.write
os.write = lambda f, data: len(data) if f == fd else _write(f, data)
for i in range(3):
    _write(fd, b'value %d ["i", "0x0"]\\n' % i)
_write(fd, b"status done\\n")
""" + WRONG_ADD
    r = run_python(takeover, TESTS)
    assert (r.passed, r.reason) == (False, "failed")
    assert r.detail == "AssertionError: assert add(40000000, 2345) == 40002345 (add(40000000, 2345) was 0)"
    duplicate = "import os, sys\nos.write(int(sys.argv[1]), b'value 1 [\"i\", \"-0xc\"]\\n')\n" \
                "def add(a, b):\n    return a + b\n"  # correct, but test 2's value arrives twice
    r = run_python(duplicate, TESTS)
    assert (r.passed, r.reason) == (False, "error") and "reported 2 times" in r.detail


def test_printing_does_not_touch_the_verdict():
    noisy = "print('value 0 [\"i\", \"0x0\"]')\nprint('status error')\ndef add(a, b):\n    return a + b\n"
    assert run_python(noisy, TESTS).passed


# ---- which tests are judged, and how --------------------------------------------------------

@pytest.mark.parametrize("test, expr, op, expected, expr_left, negated", [
    ("assert add(2, 3) == 5", "add(2, 3)", "==", 5, True, False),
    ("assert 5 == add(2, 3)", "add(2, 3)", "==", 5, False, False),
    ("assert f(x) != [1, (2, 'a')], 'msg ignored'", "f(x)", "!=", [1, (2, "a")], True, False),
    ("assert f() < -1.5", "f()", "<", -1.5, True, False),
    ("assert f() in {1, 2}", "f()", "in", {1, 2}, True, False),
    ("assert 3 not in f()", "f()", "not in", 3, False, False),
    ("assert is_even(4) is True", "is_even(4)", "is", True, True, False),
    ("assert f() is not None", "f()", "is not", None, True, False),
    ("assert is_prime(7)", "is_prime(7)", "truth", None, True, False),
    ("assert not is_prime(8)", "is_prime(8)", "truth", None, True, True),
    ("assert not f() == {'a': b'x'}", "f()", "==", {"a": b"x"}, True, True),
])
def test_supported_forms(test, expr, op, expected, expr_left, negated):
    (check,) = sandbox_checks.parse_tests(test + "\n")
    assert (check.expr, check.op, check.expected, check.expr_left, check.negated) == \
        (expr, op, expected, expr_left, negated)
    assert "msg" not in check.expr


@pytest.mark.parametrize("tests, why", [
    ("assert f(1) == 1\nx = f(2)\n", r"test 2 .*not an assert statement.*'x = f\(2\)'"),
    ("assert f(1) == g(2)\n", r"test 1 .*neither side is a literal"),
    ("assert f(1) == set([1])\n", r"neither side is a literal"),
    ("assert f(1) == 1e999 - 1e999\n", r"neither side is a literal"),
    ("assert 0 < f(1) < 3\n", r"a chained comparison"),
    ("assert f(1) is 5\n", r"'is' with a literal other than True, False or None"),
    ("for x in [1]:\n    assert f(x) == x\n", r"not an assert statement"),
    ("# nothing\n", r"no assert statement"),
    ("assert f(1) ==\n", r"tests do not compile"),
])
def test_unsupported_tests_are_refused_naming_the_test(tests, why):
    with pytest.raises(ValueError, match=why):
        sandbox_checks.parse_tests(tests)
    with pytest.raises(ValueError, match=why):
        run_python(WRONG_ADD, tests)


def test_a_refused_test_scores_zero_and_is_counted_by_the_reward_worker():
    counts, logged = Counter(), set()
    row = {"tests": "assert add(1, 2) == add(2, 1)\n"}
    answer = "```python\ndef add(a, b):\n    return a + b\n```"
    assert safe_reward(code_tests_reward, answer, row, counts, logged) == 0.0
    assert counts == {"reward_errors": 1} and logged == {"ValueError"}


def test_every_built_in_task_makes_judged_tests():
    rows = make_code_rows(300, seed=0) + [CodeTaskSource(seed=1).row_at(i).row for i in range(300)]
    ops = set()
    for row in rows:
        checks = sandbox_checks.parse_tests(row["tests"])
        ops |= {c.op for c in checks}
        assert all(c.expr_left and not c.negated for c in checks)
    assert ops == {"==", "is"}


def test_values_come_back_exactly():
    """Every data type the child reports, compared here as Python's assert would."""
    answer = """def f(k):
    return {
        "big": 2 ** 10000 + 1, "huge": 2 ** 20000, "neg": -7, "float": 0.1 + 0.2, "negzero": -0.0,
        "inf": float("inf"), "nan": float("nan"), "complex": 1 - 2j, "str": "a\\nb\\u00e9\\ud800 status done",
        "bytes": b"\\x00\\xff", "list": [1, [2.5, None]], "tuple": (1, ("x",)), "set": {1, 2},
        "frozenset": frozenset({3}), "dict": {(1, 2): {"k": [True, False]}, "z": b""}, "fsdict": {frozenset({1}): 2},
        "true": True, "one": 1, "five": 5.0,
    }[k]
"""
    tests = "\n".join([
        f"assert f('big') == {2 ** 10000 + 1}", "assert f('huge') > 1e308", "assert f('neg') == -7",
        "assert f('float') == 0.30000000000000004", "assert f('float') != 0.3", "assert f('negzero') == 0",
        "assert f('inf') == 1e999", "assert f('inf') > 1e308",
        "assert not f('nan') >= 0", "assert not f('nan') < 0", "assert f('complex') == 1-2j",
        "assert f('str') == 'a\\nb\\u00e9\\ud800 status done'", "assert f('bytes') == b'\\x00\\xff'",
        "assert f('list') == [1, [2.5, None]]", "assert f('tuple') == (1, ('x',))", "assert f('set') == {2, 1}",
        "assert f('frozenset') == {3}", "assert f('dict') == {(1, 2): {'k': [True, False]}, 'z': b''}",
        "assert f('fsdict') != {}",
        "assert f('true') == 1", "assert f('true') is True", "assert f('one') is not True", "assert f('five') == 5",
        "assert 'a' in f('str')", "assert not f('negzero')", "assert f('list')",
    ]) + "\n"
    r = run_python(answer, tests)
    assert r.passed, r


@pytest.mark.parametrize("test, reason, detail", [
    ("assert f(1) == 2", "failed", "AssertionError: assert f(1) == 2 (f(1) was 1)"),
    ("assert f(1) is True", "failed", "AssertionError: assert f(1) is True (f(1) was 1)"),
    ("assert f('a') < 3", "error", ("TypeError: '<' not supported between instances of 'str' and 'int' "
                                    "(assert f('a') < 3)")),
    ("assert f(Int(5)) == 5", "failed", ("AssertionError: assert f(Int(5)) == 5 (f(Int(5)) was of type answer.Int, "
                                         "not data (None, bool, int, float, complex, str, bytes, list, tuple, set, "
                                         "frozenset, dict))")),
    ("assert f([1, f]) == 1", "failed", "(f([1, f]) was of type builtins.function, not data"),
    ("assert f(nest(200)) == []", "failed", "nested deeper than 100"),
    ("assert f(boom()) == 1", "error", "ZeroDivisionError: division by zero"),
    ("assert f(check()) == 1", "failed", "AssertionError: raised by the answer"),
])
def test_what_a_test_that_does_not_hold_reports(test, reason, detail):
    answer = """def f(x):
    return x
class Int(int):
    pass
def nest(n):
    v = []
    for _ in range(n):
        v = [v]
    return v
def boom():
    return 1 / 0
def check():
    raise AssertionError("raised by the answer")
"""
    r = run_python(answer, test + "\n")
    assert (r.passed, r.reason) == (False, reason)
    assert detail in r.detail, r.detail


@pytest.mark.parametrize("payload", [
    "5", "1.5", '["i", "5"]', '["i", "0x1_0"]', '["f", "x"]', '["l", 1]', '["s", [["l", []]]]', '["q", []]',
    '["d", [["l", []], null]]', '["d", [[["l", []], null]]]', "[" * 200 + "]" * 200,
    '["t", [' * 150 + "[]" + "]]" * 150, "not json",
])
def test_decode_refuses_anything_but_the_encoding(payload):
    with pytest.raises(ValueError):
        sandbox_checks.decode(payload)


def test_the_first_test_that_does_not_hold_gives_the_reason():
    """As the asserts would have, run in order: a wrong value before a test that loops is "failed"."""
    loops_on_7 = "def add(a, b):\n    while a == 7:\n        pass\n    return "
    r = run_python(loops_on_7 + "a + b\n", TESTS, timeout_s=1.0)  # tests 1 and 2 hold, test 3 loops
    assert (r.passed, r.reason) == (False, "timeout")
    r = run_python(loops_on_7 + "0\n", TESTS, timeout_s=1.0)
    assert (r.passed, r.reason) == (False, "failed") and "(add(40000000, 2345) was 0)" in r.detail
