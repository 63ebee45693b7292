"""The console a run prints: per-request lines of HTTP client libraries stay off it at INFO, their
warnings stay on it, and DEBUG brings the request lines back."""

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
