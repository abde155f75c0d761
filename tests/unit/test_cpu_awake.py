"""The CPUs' wake-up latency limit a bridge may hold while a show runs (`host_bridge/wire/cpu_awake.py`)."""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import pytest

from loom_live.host_bridge.wire import cpu_awake
from loom_live.host_bridge.wire.cpu_awake import CpuAwake, idle_states

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PM QoS is Linux's")


def _open_files() -> set[str]:
    """Where this process's open file descriptors point."""
    found = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            found.add(os.readlink(fd))
        except OSError:
            continue
    return found


@linux_only
def test_the_limit_is_written_as_the_kernel_reads_it_and_given_back_on_close(tmp_path):
    """The kernel takes a 32-bit integer of microseconds, and holds it while the file stays open: the file is
    closed by close() (and by the end of a `with` block), and a second hold() asks again."""
    target = tmp_path / "cpu_dma_latency"
    target.write_bytes(b"")
    awake = CpuAwake(latency_file=target)
    assert not awake.held and awake.why == "not asked for yet"
    assert awake.hold().held and awake.why == ""
    assert target.read_bytes() == struct.pack("i", 0) and str(target) in _open_files()
    awake.close()
    assert not awake.held and str(target) not in _open_files()
    awake.close()  # twice: nothing more to give back
    with CpuAwake(latency_us=20, latency_file=target) as again:
        assert again.held and target.read_bytes()[-4:] == struct.pack("i", 20)
    assert not again.held and str(target) not in _open_files()
    dropped = CpuAwake(latency_file=target).hold()
    assert str(target) in _open_files()
    del dropped  # a holder dropped without close() gives the limit back too
    assert str(target) not in _open_files()


def test_a_limit_that_cannot_be_held_says_why_and_nothing_fails(tmp_path):
    missing = tmp_path / "no" / "cpu_dma_latency"
    awake = CpuAwake(latency_file=missing).hold()
    assert not awake.held
    if sys.platform.startswith("linux"):
        assert awake.why == f"cannot open {missing} (No such file or directory): the CPUs keep their own idle states"
    else:
        assert awake.why.endswith("the CPUs keep their own idle states")
    with pytest.raises(ValueError, match=r"^latency_us: -1 is not allowed; expected 0 or more microseconds$"):
        CpuAwake(latency_us=-1)


@linux_only
@pytest.mark.skipif(not os.access(cpu_awake.LATENCY_FILE, os.R_OK | os.W_OK),
                    reason="/dev/cpu_dma_latency is absent or not writable here (root, or a udev rule)")
def test_the_real_limit_is_held_at_zero_while_held():
    """On the real file the kernel answers a read with the limit in force: 0 while this request holds it (any other
    request can only lower it further). What it goes back to depends on the machine's other requests."""
    with CpuAwake() as awake:
        assert awake.held
        assert struct.unpack("i", cpu_awake.LATENCY_FILE.read_bytes()[:4])[0] == 0
    assert str(cpu_awake.LATENCY_FILE) not in _open_files()


def test_idle_states_are_what_the_kernel_lists(tmp_path, monkeypatch):
    states = tmp_path / "cpuidle"
    for number, (name, latency) in enumerate([("POLL", "0"), ("C1", "2"), ("C6", "170")]):
        (states / f"state{number}").mkdir(parents=True)
        (states / f"state{number}" / "name").write_text(f"{name}\n")
        (states / f"state{number}" / "latency").write_text(f"{latency}\n")
    driver = tmp_path / "current_driver"
    driver.write_text("intel_idle\n")
    monkeypatch.setattr(cpu_awake, "IDLE_STATES", states)
    monkeypatch.setattr(cpu_awake, "IDLE_DRIVER", driver)
    assert idle_states() == {"driver": "intel_idle", "states": [{"name": "POLL", "latency_us": 0},
                                                                {"name": "C1", "latency_us": 2},
                                                                {"name": "C6", "latency_us": 170}]}
    monkeypatch.setattr(cpu_awake, "IDLE_STATES", tmp_path / "none")
    monkeypatch.setattr(cpu_awake, "IDLE_DRIVER", tmp_path / "none")
    assert idle_states() == {}
