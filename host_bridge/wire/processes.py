"""Process helpers both sides need: whether a peer process still exists, portably."""

from __future__ import annotations

import os

PROCESS_QUERY_LIMITED_INFORMATION = 0x1000  # Windows OpenProcess access right
STILL_ACTIVE = 259  # Windows GetExitCodeProcess: still running


def pid_alive(pid: int) -> bool:
    """Whether a process exists. Portable: on Windows `os.kill(pid, 0)` would send CTRL_C_EVENT."""
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
    return True
