"""`loom play --standby`: a second engine kept loaded takes over when the one in use is killed mid-show, and the
player says when the show is covered and who took over (pass-through engines: the mechanism, not a model)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"standby engine ready \(pid (\d+); the engine in use is pid (\d+)\)")


def _play(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "play", *args], stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kwargs)


def test_a_killed_engine_is_taken_over_by_the_standby_and_the_show_goes_on(tmp_path):
    out = tmp_path / "show.mp4"
    proc = _play("--passthrough", "--standby", "--mode", "live", "-n", "2000", "--size", "96x64", "-o", str(out))
    timer = threading.Timer(180, proc.kill)  # a hung run fails the test instead of the suite
    timer.start()
    lines, killed, took_over = [], None, None
    try:
        for line in proc.stderr:
            lines.append(line.rstrip())
            ready = READY.search(line)
            if ready and killed is None:
                standby, killed = int(ready.group(1)), int(ready.group(2))
                os.kill(killed, signal.SIGKILL)  # the engine in use dies mid-show
            elif killed is not None and "took over" in line:
                took_over = line
                proc.send_signal(signal.SIGINT)  # the show was covered: end it as a user would
        code = proc.wait(60)
    finally:
        timer.cancel()
        proc.kill()
    said = "\n".join(lines)
    assert killed is not None, said
    assert took_over is not None and f"the standby engine (pid {standby}) took over from pid {killed}" in took_over, \
        said
    assert code == 130, said  # ended by the Ctrl-C, not by the kill
    assert re.search(r"loom play: stopped by Ctrl-C; \d+ frames", said), said
    import av

    with av.open(str(out)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) > 10 and all(np.asarray(f).shape == (64, 96, 3) for f in frames)


def test_standby_with_a_served_engine_is_refused_before_anything_starts():
    proc = _play("--standby", "--endpoint", "tcp://127.0.0.1:9", "-n", "5")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1] == ("loom play: error: --standby keeps a second engine this command starts; a "
                                             "served engine (--endpoint) is not started here: leave out one of them")
