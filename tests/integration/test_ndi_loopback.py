"""NDI loopback through the real NDI runtime (cyndilib's bundled libndi): a Loom sender and Loom
receivers in separate processes on this machine.

NDI discovery is mDNS, which containers and CI runners often do not pass; the processes are pointed
at 127.0.0.1 through an NDI config file instead (the same set-up the README gives for networks
without multicast). Skipped with the reason when cyndilib is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("cyndilib", reason="NDI loopback needs cyndilib (pip install 'loom-live[ndi]')")

ROOT = Path(__file__).resolve().parents[2]
PEER = [sys.executable, "-m", "tests.integration.ndi_peer"]
MARK_A, MARK_B = 200, 40  # blue levels of the first and the second sender
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def ndi_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "ndi-config.v1.json").write_text(json.dumps({"ndi": {"networks": {"ips": "127.0.0.1"}}}))
    return {**os.environ, "NDI_CONFIG_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}


def _start(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([*PEER, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _events(proc: subprocess.Popen, stop: callable) -> list[dict]:
    """Lines of a receiver until ``stop(events)`` or its end; a receiver that fails shows its stderr."""
    events: list[dict] = []
    for line in proc.stdout:
        events.append(json.loads(line))
        if stop(events):
            return events
    proc.wait()
    if proc.returncode:
        err = proc.stderr.read()
        if "runtime" in err or "libndi" in err:
            pytest.skip(f"the NDI runtime does not start here: {err.strip()[-300:]}")
        raise AssertionError(f"receiver exited {proc.returncode}: {err[-2000:]}")
    return events


def _frames(events: list[dict], mark: int | None = None) -> list[dict]:
    return [e for e in events if "frame" in e and (mark is None or abs(e["blue"] - mark) < 30)]


def _whole_and_in_order(frames: list[dict]) -> None:
    assert all(f["shape"] == [64, 256, 3] and f["clean"] for f in frames), frames
    indexes = [f["frame"] for f in frames]
    assert indexes == sorted(set(indexes)), indexes  # newest-frame delivery skips frames, never reorders


def test_ndi_frames_in_order_across_a_receiver_and_a_sender_that_come_back(ndi_env):
    name = f"loom-test-{uuid.uuid4().hex[:8]}"
    procs = [_start(ndi_env, "send", name, str(MARK_A)), _start(ndi_env, "receive", name, "6")]
    try:
        first = _events(procs[1], lambda ev: False)  # it reads 6 frames and goes away
        assert len(_frames(first, MARK_A)) == 6, first
        _whole_and_in_order(_frames(first))
        # A receiver that comes back connects again and sees later frames; it stays while the
        # sender goes away and another one starts under the same name.
        procs.append(_start(ndi_env, "receive", name, "1000", "1.0"))
        again = _events(procs[2], lambda ev: len(_frames(ev)) >= 4)
        assert _frames(again)[0]["frame"] > _frames(first)[-1]["frame"]
        procs[0].kill()
        procs[0].wait()
        # the receiver holds its last picture, then reports the loss; only then the new sender starts
        # (one back within the read timeout is picked up by the NDI runtime's own reconnect)
        again += _events(procs[2], lambda ev: any(e.get("message", "").startswith("input lost") for e in ev))
        procs.append(_start(ndi_env, "send", name, str(MARK_B)))
        again += _events(procs[2], lambda ev: len(_frames(ev, MARK_B)) >= 4)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    messages = [e["message"] for e in again if "message" in e]
    assert any(m.startswith("input lost") for m in messages), messages
    assert any(m.startswith("input reconnected") for m in messages), messages
    _whole_and_in_order(_frames(again, MARK_A))
    _whole_and_in_order(_frames(again, MARK_B))
    marks = [abs(f["blue"] - MARK_A) < 30 for f in _frames(again)]
    assert marks == sorted(marks, reverse=True), "frames of the first sender after the second one's"
