"""Process helpers both sides need: whether a peer process still exists, portably."""

from __future__ import annotations

import os

PROCESS_QUERY_LIMITED_INFORMATION = 0x1000  # Windows OpenProcess access right
STILL_ACTIVE = 259  # Windows GetExitCodeProcess: still running


def pid_alive(pid: int) -> bool:
    """Whether a process runs. Portable: on Windows `os.kill(pid, 0)` would send CTRL_C_EVENT. An exited
    process its parent has not reaped yet (a zombie) is not alive: what it held may be swept at once. A number
    no process can have (a pid read from a name someone made by hand) is not alive either: `os.kill` would
    signal a process group for 0 or a negative, and overflow for a huge one."""
    if not 0 < pid < 2**31:
        return False
    if os.name == "nt":
        import ctypes

        kernel32 = ctypes.windll.kernel32
        handle = kernel32.OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, False, pid)
        if not handle:
            return False
        code = ctypes.c_ulong()
        ok = kernel32.GetExitCodeProcess(handle, ctypes.byref(code))
        kernel32.CloseHandle(handle)
        return bool(ok) and code.value == STILL_ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to someone else
    return not zombie(pid)


def zombie(pid: int) -> bool:
    """Linux: whether the process has exited and waits to be reaped (its state in /proc is Z); False elsewhere."""
    fields = _stat(pid)
    return fields is not None and fields[0] == b"Z"


def group_runs(pgid: int) -> bool:
    """Linux: whether a process of the group has not exited (zombies nobody reaps, under a host that is a
    container's first process, hold nothing); True where /proc cannot tell."""
    if not os.path.exists("/proc/self/stat"):
        return True
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and fields[0] != b"Z" and int(fields[2]) == pgid:
            return True
    return False


def _stat(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command's name (state, ppid, pgrp, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()
