"""Start and stop an engine process, whole process tree included, portably.

The engine runs in another interpreter (TouchDesigner's Python has no torch), in its own process
group (POSIX: a new session; Windows: CREATE_NEW_PROCESS_GROUP) so that stopping it reaches every
process it started (torch workers, pipeline-parallel ranks) and so a Ctrl-C meant for the host
does not hit it. Stop is: terminate the group, wait, kill the group. Its output is kept as a short
tail for the host's status display.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from host_bridge.wire import logs

LOG_TAIL_LINES = 40
TOKEN_ENV = "LOOM_BRIDGE_TOKEN"  # the launch token travels in the environment, not on the visible command line


class EngineProcess:
    """One launched engine; `alive`, `stop()`, and the last lines it printed."""

    def __init__(self, argv: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None):
        self.argv = argv
        self._tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        kwargs: dict = {}
        if os.name == "nt":
            kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
        else:
            kwargs["start_new_session"] = True
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

    def log_tail(self, lines: int = 10) -> list[str]:
        return list(self._tail)[-lines:]

    def stop(self, timeout_s: float = 2.0) -> int | None:
        """Terminate the process group, wait up to `timeout_s`, then kill it. Returns the exit code."""
        if self.alive:
            _signal_tree(self.proc, kill=False)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
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


def _signal_tree(proc: subprocess.Popen, *, kill: bool) -> None:
    if os.name == "nt":
        if kill:
            subprocess.run(["taskkill", "/F", "/T", "/PID", str(proc.pid)], capture_output=True, check=False)
        elif proc.poll() is None:
            proc.send_signal(signal.CTRL_BREAK_EVENT)  # reaches the whole new process group
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)  # pgid == pid: new session
    except (ProcessLookupError, PermissionError):
        pass


def engine_argv(python: str | None, *args: str) -> list[str]:
    """The engine's command line; it logs at this process's level (`args` may still set another)."""
    return [python or sys.executable, "-m", "engine", "serve", *logs.engine_args(), *args]
