"""Keep the machine's CPUs out of deep idle states while frames are handed over at a host's pace.

A paced handoff crosses two processes that both sleep between frames. A core that went idle wakes slowly: from a
deep C-state, and in a virtual machine from a halted virtual CPU that the hypervisor must schedule again; every step
of the next frame then runs on a cold core. Linux keeps a system-wide limit on how long a CPU may take to wake up
(PM QoS): a process writes the limit to /dev/cpu_dma_latency and it holds while that file stays open, so it ends
with the process, however it ends. Writing needs permission on that file (root, or a udev rule that grants it); other
systems have no such file. Either way the stream runs, and `CpuAwake.why` says why the limit is not held.

The cost is power: idle cores poll instead of sleeping, for as long as the limit is held.
"""

from __future__ import annotations

import os
import struct
import sys
import weakref
from pathlib import Path

LATENCY_FILE = Path("/dev/cpu_dma_latency")
IDLE_STATES = Path("/sys/devices/system/cpu/cpu0/cpuidle")
IDLE_DRIVER = Path("/sys/devices/system/cpu/cpuidle/current_driver")


class CpuAwake:
    """A wake-up latency limit: `hold()` asks for it, `held` says whether it holds, `why` why not; `close()` (or the
    end of the process) gives it back. A context manager holds it for its block."""

    def __init__(self, latency_us: int = 0, latency_file: Path | None = None) -> None:
        if latency_us < 0:
            raise ValueError(f"latency_us: {latency_us} is not allowed; expected 0 or more microseconds")
        self.latency_us, self.latency_file = latency_us, latency_file or LATENCY_FILE
        self._release: weakref.finalize | None = None  # closes the file: at close(), or when dropped unclosed
        self.why = "not asked for yet"

    @property
    def held(self) -> bool:
        return self._release is not None and self._release.alive

    def hold(self) -> CpuAwake:
        """Ask for the limit (again after `close()`); where it cannot be had, `why` says so and nothing fails."""
        if self.held:
            return self
        keep = "the CPUs keep their own idle states"
        if not sys.platform.startswith("linux"):
            self.why = f"{sys.platform} has no {self.latency_file}: {keep}"
            return self
        try:
            fd = os.open(self.latency_file, os.O_WRONLY)
        except OSError as exc:
            self.why = f"cannot open {self.latency_file} ({exc.strerror}): {keep}"
            return self
        try:
            os.write(fd, struct.pack("i", self.latency_us))
        except OSError as exc:
            os.close(fd)
            self.why = f"cannot write {self.latency_file} ({exc.strerror}): {keep}"
            return self
        self._release, self.why = weakref.finalize(self, os.close, fd), ""
        return self

    def close(self) -> None:
        if self.held:
            self._release()  # the kernel drops the limit with the last open file of this request
            self.why = "given back"

    def __enter__(self) -> CpuAwake:
        return self.hold()

    def __exit__(self, *_: object) -> None:
        self.close()


def idle_states() -> dict[str, object]:
    """The CPUs' idle driver and cpu0's idle states (name and wake-up latency in microseconds), as the kernel says
    them: what a held limit rules out. Empty where the kernel says nothing (no cpuidle, not Linux)."""
    states = []
    for folder in sorted(IDLE_STATES.glob("state*"), key=lambda p: int(p.name[5:] or 0)):
        try:
            states.append({"name": (folder / "name").read_text().strip(),
                           "latency_us": int((folder / "latency").read_text())})
        except (OSError, ValueError):
            continue
    try:
        driver = IDLE_DRIVER.read_text().strip()
    except OSError:
        driver = ""
    return {"driver": driver, "states": states} if driver or states else {}
