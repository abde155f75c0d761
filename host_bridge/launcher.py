"""Start and stop an engine process, whole process tree included, portably.

The engine runs in another interpreter (TouchDesigner's Python has no torch), in its own process
group (POSIX: a new session; Windows: CREATE_NEW_PROCESS_GROUP) so that stopping it reaches every
process it started (torch workers, pipeline-parallel ranks) and so a Ctrl-C meant for the host
does not hit it. On Windows it also gets CREATE_NO_WINDOW: launched from GUI TouchDesigner it would
otherwise open a console window. Without a console there is no Ctrl-Break to send, so a Windows
stop asks the tree to end (`taskkill /T`), waits, then ends it by force (`taskkill /F /T`), which
reaches a hung engine too; the bridge has already said "bye" on the control channel by then.
POSIX: terminate the group, wait, kill the group. Its output is kept as a short tail for the
host's status display, and an engine that refused its run (exit code 2) is told apart from a crash
by its own one-line error, so the host can say why once instead of restarting it.

The engine is `python -m loom_live.engine`: in a host that found Loom in a source checkout rather than an
installed package (ComfyUI's node folder linked from a checkout, TouchDesigner's Python given the
checkout's path), the engine's Python would not find it, so the checkout goes first on the engine's
PYTHONPATH. An installed Loom is left to the engine's own environment: another Python's
site-packages on its path would shadow its own compiled packages.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from loom_live.host_bridge.wire import logs
from loom_live.host_bridge.wire.checkout import loom_checkout
from loom_live.host_bridge.wire.errors import EXIT_USER_ERROR, SERVE_ERROR_PREFIX
from loom_live.host_bridge.wire.processes import group_runs

LOG_TAIL_LINES = 40
LOG_TAIL_SHOWN = 10  # the last lines of output a host's status shows (two engines' lines share them)
TOKEN_ENV = "LOOM_BRIDGE_TOKEN"  # the launch token travels in the environment, not on the visible command line
# Windows process creation flags (subprocess defines them only on Windows)
CREATE_NEW_PROCESS_GROUP = 0x00000200
CREATE_NO_WINDOW = 0x08000000


def popen_options(os_name: str | None = None) -> dict:
    """Popen keywords that give the engine a process group of its own (and no console window on Windows)."""
    if (os_name or os.name) == "nt":
        return {"creationflags": CREATE_NEW_PROCESS_GROUP | CREATE_NO_WINDOW}
    return {"start_new_session": True}


class EngineProcess:
    """One launched engine; `alive`, `stop()`, and the last lines it printed."""

    def __init__(self, argv: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None):
        self.argv = argv
        self._tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        kwargs = popen_options()
        full_env = dict(os.environ)
        full_env["PYTHONUNBUFFERED"] = "1"
        if env:
            full_env.update(env)
        self.proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, **kwargs)
        self.pid = self.proc.pid
        self.started = time.monotonic()
        self._reader = threading.Thread(target=self._read_output, name=f"loom-engine-log-{self.pid}", daemon=True)
        self._reader.start()

    def _read_output(self) -> None:
        stream = self.proc.stdout
        assert stream is not None
        for raw in iter(stream.readline, b""):
            self._tail.append(raw.decode("utf-8", "replace").rstrip())
        stream.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def last_words(self) -> str:
        """The last line an exited engine printed (its error, usually)."""
        self._reader.join(timeout=0.5)
        return self._tail[-1] if self._tail else ""

    def ending(self) -> str:
        """How an exited engine ended, for the host's message. Killed by a signal (kill -9, the OOM killer),
        its last line is only what it said before, often a routine log line: given as that, not as the cause."""
        code, last = self.returncode, self.last_words()
        if code is not None and code < 0:  # POSIX: -N is death by signal N
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"engine killed by {name}" + (f" (its last output: {last})" if last else "")
        return f"engine exited with code {code}" + (f": {last}" if last else "")

    def refusal(self) -> str | None:
        """The engine's own error when it exited refusing its run (a bad config, missing weights), else None.

        Only exit code 2 means that; any other end (a signal, a crash) is not the user's to fix."""
        if self.returncode != EXIT_USER_ERROR:
            return None
        self._reader.join(timeout=0.5)
        for line in reversed(self._tail):
            _, found, text = line.partition(SERVE_ERROR_PREFIX)
            if found and text.strip():
                return text.strip()
        return self.last_words() or f"the engine exited with code {EXIT_USER_ERROR}"

    def log_tail(self, lines: int = LOG_TAIL_SHOWN) -> list[str]:
        return list(self._tail)[-lines:]

    def stop(self, timeout_s: float = 2.0) -> int | None:
        """Terminate the process group, wait up to `timeout_s`, then kill it. Returns the exit code."""
        deadline = time.monotonic() + timeout_s
        if self.alive or _group_alive(self.proc):  # a leader that died leaves children: ask them too
            _signal_tree(self.proc, kill=False)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # what is left of the group gets until the deadline: a resource tracker (pipeline ranks) ignores
        # SIGTERM and unlinks the semaphores the engine left once the others are gone; killed, it leaks them
        while _group_alive(self.proc) and time.monotonic() < deadline:
            time.sleep(0.02)
        # kill the group even when the leader is gone: its children may linger
        _signal_tree(self.proc, kill=True)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=1.0)
        return self.proc.poll()

    def kill(self) -> None:
        _signal_tree(self.proc, kill=True)


def _group_alive(proc: subprocess.Popen, os_name: str | None = None) -> bool:
    """POSIX: whether a process of the engine's group (the leader reaped) still runs; Windows: False."""
    if (os_name or os.name) == "nt":
        return False
    proc.poll()  # a dead leader not reaped yet would count
    try:
        os.killpg(proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return group_runs(proc.pid)


def _signal_tree(proc: subprocess.Popen, *, kill: bool, os_name: str | None = None,
                 run: Callable[..., object] = subprocess.run) -> None:
    if (os_name or os.name) == "nt":
        if kill:
            run(["taskkill", "/F", "/T", "/PID", str(proc.pid)], capture_output=True, check=False)
        elif proc.poll() is None:  # no console, so no Ctrl-Break: ask the tree to close
            run(["taskkill", "/T", "/PID", str(proc.pid)], capture_output=True, check=False)
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)  # pgid == pid: new session
    except (ProcessLookupError, PermissionError):
        pass


def engine_env(base: dict[str, str] | None = None, checkout: Path | None = None) -> dict[str, str]:
    """Environment additions for a launched engine: PYTHONPATH with Loom's checkout first, if any."""
    root = checkout or loom_checkout()
    if root is None:
        return {}
    current = (os.environ if base is None else base).get("PYTHONPATH", "")
    parts = [p for p in current.split(os.pathsep) if p and Path(p).resolve() != root]
    return {"PYTHONPATH": os.pathsep.join([str(root), *parts])}


def engine_argv(python: str | None, *args: str) -> list[str]:
    """The engine's command line; it logs at this process's level (`args` may still set another)."""
    return [python or sys.executable, "-m", "loom_live.engine", "serve", *logs.engine_args(), *args]
