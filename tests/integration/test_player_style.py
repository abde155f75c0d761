"""`loom play` tells which of the embedded model's styles a free-text prompt landed on, as a user sees it.

Real `python -m loom_live.plugin.cli play` processes with their engines; the expected style comes from the
shipped style table itself (engine/stream/style_text.py), so a table retrained with other styles
keeps these tests true.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from loom_live.engine.stream.style_text import StyleTextEncoder, table_path
from loom_live.plugin.player.style_line import style_name
from tests.fakes.engines import wait_until
from tests.fakes.media import free_udp_port

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _expected(prompt: str) -> str:
    """The start of the line the player prints for `prompt`: its style and similarity from the table."""
    with np.load(table_path()) as t:
        dim = t["condition"].shape[1]
    match = StyleTextEncoder(dim, 1).describe(prompt)
    return f'style: "{prompt}" -> {style_name(match.style)} (similarity {match.similarity:.2f}'


def _play(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "play", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=cwd, env=ENV)


def test_a_file_run_says_the_style_of_a_free_text_prompt_before_its_frames(tmp_path):
    prompt = "a charcoal drawing of a goat"
    out = _play("-n", "5", "--size", "64x64", "-p", prompt, "-o", "styled.mp4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if _expected(prompt) in line]
    assert len(said) == 1, out.stderr
    first_progress = next(i for i, line in enumerate(lines) if "/5 [" in line)
    assert said[0] < first_progress, "the style is said before the frames go out"
    assert ", style " in lines[first_progress], "the progress line shows the style too"


def test_a_live_run_says_the_style_at_start_and_after_each_prompt_change(tmp_path):
    pytest.importorskip("pythonosc", reason="OSC input needs the osc extra (python-osc)")
    from pythonosc.udp_client import SimpleUDPClient

    port = free_udp_port()
    proc = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "play", "--mode", "live", "--loop", "-n",
                             "100000", "--size", "64x64", "-p", "ink wash", "-o", "live.mp4", "--osc-port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # list.extend: one line a time
    reader.start()
    try:
        assert wait_until(lambda: any(_expected("ink wash") in s for s in lines) or proc.poll() is not None,
                          RUN_TIMEOUT_S), "".join(lines)
        assert proc.poll() is None, "".join(lines)
        client = SimpleUDPClient("127.0.0.1", port)
        client.send_message("/loom/prompt", ["an infrared heat camera"])
        assert wait_until(lambda: any(_expected("an infrared heat camera") in s for s in lines)
                          or proc.poll() is not None, RUN_TIMEOUT_S), "".join(lines)
        assert wait_until(lambda: any(s.startswith("live ") and " style " in s for s in lines), RUN_TIMEOUT_S)
        client.send_message("/loom/quit", [])
        proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert proc.returncode == 0, "".join(lines)
