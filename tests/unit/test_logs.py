"""One logging setup for both entry points, and the level travels from a host to the engine it starts."""

from __future__ import annotations

import argparse
import logging

import pytest

from loom_live.engine.server.main import add_parser as add_serve_parser
from loom_live.host_bridge.launcher import engine_argv
from loom_live.host_bridge.wire import logs
from loom_live.plugin.cli.main import build_parser


@pytest.fixture(autouse=True)
def _restore_logging():
    levels = {p: logging.getLogger(p).level for p in logs.PACKAGES}
    handlers, configured = list(logging.getLogger().handlers), logs._configured
    yield
    for p, level in levels.items():
        logging.getLogger(p).setLevel(level)
    logging.getLogger().handlers[:] = handlers
    logs._configured = configured


def test_records_of_loom_modules_reach_stderr_at_the_chosen_level(capsys):
    logs.configure("warning")
    logging.getLogger("loom_live.engine.server.core").info("quiet")
    logging.getLogger("loom_live.engine.server.core").warning("host silent for 5.1 s")
    logs.configure("debug")
    logs.configure("debug")  # configuring twice adds no second handler
    logging.getLogger("loom_live.host_bridge.launcher").debug("started")
    err = capsys.readouterr().err.splitlines()
    assert err == ["WARNING loom_live.engine.server.core: host silent for 5.1 s",
                   "DEBUG loom_live.host_bridge.launcher: started"]


def test_a_bad_level_names_the_allowed_ones():
    with pytest.raises(ValueError, match="'loud'.*allowed: debug, info, warning, error"):
        logs.configure("loud")


def test_the_launcher_passes_the_hosts_level_to_the_engine():
    logs._configured = None
    assert "--log-level" not in engine_argv("python", "--connect", "ipc://x")  # nothing chosen: engine default
    logs.configure("DEBUG")
    argv = engine_argv("python", "--connect", "ipc://x", "--log-level", "error")
    assert argv[:6] == ["python", "-m", "loom_live.engine", "serve", "--log-level", "debug"]
    assert argv[-2:] == ["--log-level", "error"]  # a host's own engine_args come later and win


def test_log_level_is_a_global_loom_option_and_a_serve_option():
    parser = build_parser()
    assert parser.parse_args(["--log-level", "debug", "info"]).log_level == "debug"
    assert parser.parse_args(["info"]).log_level == "info"
    assert parser.parse_args(["--log-level", "error", "serve", "--bind", "tcp://127.0.0.1:1"]).log_level == "error"
    assert parser.parse_args(["serve", "--bind", "tcp://127.0.0.1:1", "--log-level", "WARNING"]).log_level \
        == "warning"
    engine = argparse.ArgumentParser(prog="python -m loom_live.engine")
    logs.add_option(engine)
    add_serve_parser(engine.add_subparsers(dest="command", required=True))
    assert engine.parse_args(["serve", "--connect", "ipc://x", "--log-level", "debug"]).log_level == "debug"
    assert engine.parse_args(["serve", "--connect", "ipc://x"]).log_level == "info"
    with pytest.raises(SystemExit):
        engine.parse_args(["serve", "--connect", "ipc://x", "--log-level", "loud"])
