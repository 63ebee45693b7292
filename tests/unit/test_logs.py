"""The console a run prints: per-request lines of HTTP client libraries stay off it at INFO, their
warnings stay on it, and DEBUG brings the request lines back; an actor's interpreter teardown
(Triton's nanobind leak report) stays off it."""

from __future__ import annotations

import logging

import pytest

from disagg.logs import PER_REQUEST_LOGGERS, setup_logging


@pytest.fixture
def console():
    root = logging.getLogger()
    saved = (root.level, root.handlers[:], {n: logging.getLogger(n).level for n in PER_REQUEST_LOGGERS})
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    root.handlers = [Keep()]
    yield records
    root.setLevel(saved[0])
    root.handlers = saved[1]
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def test_http_request_lines_are_kept_off_the_console_at_info_and_back_at_debug(console):
    setup_logging("agent", "INFO")
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).info('HTTP Request: POST http://127.0.0.1:1/v1/completions "HTTP/1.1 200 OK"')
        logging.getLogger(name).warning("retrying after a 503")
    logging.getLogger("disagg.agent").info("step 3: 12 episodes")
    lines = [(r.name, r.getMessage()) for r in console]
    assert lines == [(n, "retrying after a 503") for n in PER_REQUEST_LOGGERS] + [("disagg.agent", "step 3: 12 episodes")]
    assert all(r.role == "agent" for r in console)

    console.clear()
    setup_logging("agent", "DEBUG")
    logging.getLogger("httpx").info("HTTP Request: POST ...")
    assert [r.getMessage() for r in console] == ["HTTP Request: POST ..."]


_TEARDOWN_CHILD = """
import os, sys
from disagg.logs import setup_logging


class Leaky:  # what an extension module does in the interpreter's teardown: writes to fd 2
    def __del__(self):
        os.write(2, b"nanobind: leaked 514 functions!\\n")


sys.modules["leaky_extension"] = Leaky()  # torn down with the modules, after the exit handlers
setup_logging("trainer:0", "INFO", actor={actor})
import logging
logging.getLogger("disagg.test").warning("said while running")
"""


@pytest.mark.parametrize("actor", [True, False])
def test_an_actor_leaves_without_its_teardown_report_and_keeps_what_it_said(actor):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TEARDOWN_CHILD.format(actor=actor)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "[trainer:0] disagg.test: said while running" in out.stderr
    assert ("nanobind" in out.stderr) is not actor, out.stderr
