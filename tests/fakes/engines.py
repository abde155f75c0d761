"""Engines for tests: a real EngineServer on a thread of this process, and the polling helpers the
multi-process tests wait with.

A server in this process needs no engine process to start (a second or more on a loaded machine),
and lets a test reach into it (its worker's counters) or hand it a fake session class.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from loom_live.engine.server.core import EngineServer
from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge.wire.channel import Channel, SharedSecret, read_secret_file
from loom_live.host_bridge.wire.errors import SERVE_ERROR_PREFIX


def wait_until(ready: Callable[[], object], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll `ready()` until it is true or `timeout_s` passes; True if it became true.

    Timeouts are upper bounds for a loaded machine, never the behaviour under test: a passing wait
    returns as soon as the condition holds.
    """
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            return bool(ready())
        time.sleep(interval_s)
    return True


def indexed_frame(i: int, h: int = 24, w: int = 32) -> np.ndarray:
    """An RGB uint8 frame whose content identifies its index `i`."""
    return np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)


class InProcessEngine:
    """An EngineServer serving `session_cls` on a daemon thread with a session secret, as `loom serve` on
    this machine does; a Bridge connects with `launch=False` to `endpoint`, given `secret_file` (or `host`
    gives those settings). `start`: what its ready message says the session starts on (none: not said).
    `exit_code` holds what `run()` returned once the server has ended."""

    def __init__(self, session_cls: Callable[[], Any], bind: str = "tcp://127.0.0.1:*",
                 heartbeat_s: float = 0.1, start: dict[str, Any] | None = None) -> None:
        self._secret_dir = tempfile.mkdtemp(prefix="loom-test-secret-")
        self.secret_file = os.path.join(self._secret_dir, "secret")
        secret = SharedSecret(read_secret_file(self.secret_file, create=True), server=True)
        self.server = EngineServer(session_cls, bind=bind, heartbeat_s=heartbeat_s, curve=secret, start=start)
        self.exit_code: list[int] = []
        self.thread = threading.Thread(target=lambda: self.exit_code.append(self.server.run()), daemon=True,
                                       name="test-engine-server")
        self.thread.start()
        if not wait_until(lambda: self.server.channel is not None, 10, 0.01):
            self.stop()
            raise AssertionError("the in-process engine server did not bind within 10 s")

    @property
    def endpoint(self) -> str:
        return self.server.channel.endpoint

    @property
    def host(self) -> dict[str, Any]:
        """The BridgeConfig settings that reach this engine."""
        return dict(launch=False, endpoint=self.endpoint, secret_file=self.secret_file)

    def stop(self) -> None:
        """Ask the server to stop and wait for its thread (it must end: a test asserts nothing lingers)."""
        self.server.request_stop()
        self.thread.join(10)
        shutil.rmtree(self._secret_dir, ignore_errors=True)
        assert not self.thread.is_alive(), "the in-process engine server did not stop within 10 s"

    def __enter__(self) -> InProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ConfigSessions:
    """Pass-through sessions (`InProcessEngine(sessions, start=sessions.start)`) that take live parameters as a session
    of `cfg` does: one its model family does not take is refused by name (`LoomConfig.with_live`) and kept, in its
    words, in that session's `refused`. Each session built is in `built`; `start` is what its ready message says."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.start = cfg.start_settings()
        self.built: list[PassthroughSession] = []

    def __call__(self) -> PassthroughSession:
        session = _ConfigSession(self.cfg)
        self.built.append(session)
        return session


class _ConfigSession(PassthroughSession):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.refused: list[str] = []

    def set_params(self, **params: Any) -> None:
        try:
            self.cfg = self.cfg.with_live(params)
        except ValueError as exc:
            self.refused.append(str(exc))
            raise
        super().set_params(**params)


def engine_report(bridge: Any, ready: Callable[[dict], bool], timeout_s: float = 10.0) -> dict:
    """The engine's own report (sent about once a second, in `bridge.stats()["engine"]`) once
    `ready(report)` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = bridge.stats()["engine"]
        if ready(report):
            return report
        if time.monotonic() > deadline:
            raise AssertionError(f"engine never reported the expected state: {report}")
        time.sleep(0.05)


def exiting_engine(folder: Path, code: int, error: str = "", name: str = "engine-python") -> Path:
    """An 'engine Python' (BridgeConfig.engine_python, --engine-python) that says `error` the way the engine
    process does and exits with `code` at once, whatever it is asked to run (POSIX: a shell script).
    Exit code 2 is the engine refusing its run; any other code is a crash."""
    path = folder / name
    said = f"printf '%s\\n' {shlex.quote(SERVE_ERROR_PREFIX + error)} >&2\n" if error else ""
    path.write_text(f"#!/bin/sh\necho 'engine starting'\n{said}exit {code}\n")
    os.chmod(path, 0o755)
    return path


@contextlib.contextmanager
def served_engine(folder: Path, *args: str, startup_s: float = 60.0) -> Iterator[tuple[str, str]]:
    """`loom serve --bind` on a free loopback port with a session secret, as a process of its own (pass-through
    unless `args` say otherwise): yields (endpoint, secret file) and stops it afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint, secret = f"tcp://127.0.0.1:{port}", folder / "served.secret"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "serve", "--bind", endpoint, "--secret-file",
                             str(secret), *(args or ("--passthrough",))], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, stderr=subprocess.PIPE, text=True)
    try:
        up = wait_until(lambda: proc.poll() is not None or _listens(port), startup_s, 0.1)
        assert up and proc.poll() is None and secret.exists(), "loom serve did not come up"
        yield endpoint, str(secret)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _listens(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


class GuardedSockets:
    """Raw sockets bound on loopback that let in only peers holding one fresh session secret, as an engine
    `loom serve` runs on this machine does: a test drives them by hand as a fake engine's control socket
    and frame lane, and gives hosts `secret_file`. `close()` before the context is terminated."""

    def __init__(self, ctx: zmq.Context, folder: Path) -> None:
        self.secret_file = str(folder / "fake-engine.secret")
        self._secret = SharedSecret(read_secret_file(self.secret_file, create=True), server=True)
        self._ctx = ctx
        self._channels: list[Channel] = []

    def bind(self) -> tuple[zmq.Socket, int]:
        """A DEALER bound to a free loopback port behind the secret, and that port."""
        channel = Channel(self._ctx, "tcp://127.0.0.1:*", bind=True, curve=self._secret)
        self._channels.append(channel)
        return channel.sock, int(channel.endpoint.rpartition(":")[2])

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels = []


def python_without_loom(folder: Path, honour_pythonpath: bool) -> Path:
    """A Python with this one's packages (torch) but no Loom: neither the editable install nor a folder
    holding Loom's packages is on its path, except (`honour_pythonpath`) folders PYTHONPATH names."""
    path = folder / "python-without-loom"
    path.write_text(f"""#!{sys.executable}
import importlib.util, os, runpy, sys
allowed = os.environ.get("PYTHONPATH", "").split(os.pathsep) if {honour_pythonpath!r} else []
sys.meta_path = [f for f in sys.meta_path
                 if "editable" not in (f if isinstance(f, type) else type(f)).__module__.lower()]
sys.path = [p for p in sys.path[1:] if p in allowed or not os.path.isdir(os.path.join(p or ".", "host_bridge"))]
assert sys.argv[1] == "-m", sys.argv
module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
try:
    found = importlib.util.find_spec(module)
except ModuleNotFoundError as exc:  # its parent package is missing, as `python -m` says it
    sys.exit(f"{str(path)}: Error while finding module specification for {{module!r}} (ModuleNotFoundError: {{exc}})")
if found is None:
    sys.exit(f"{str(path)}: No module named {{module}}")
runpy.run_module(module, run_name="__main__", alter_sys=True)
""")
    path.chmod(0o755)
    return path


def lacking(*modules: str) -> str:
    """Lines to run first in a `python -c` script: importing these top-level modules (and their submodules)
    fails as in a Python that lacks them (a host's Python without pyzmq), whatever this Python has."""
    return textwrap.dedent(f"""
        import sys
        class Lacking:
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name.partition(".")[0] in {modules!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, Lacking)
    """)
