"""Sleeping in the kernel until another process changes a 32-bit word in shared memory.

Why: a reader that polls a shared counter either burns a core or, sleeping between looks, wakes
late; here it sleeps on the word itself and the writer's wake call ends the sleep at once.

Backends, chosen once per process:
- Linux: futex(FUTEX_WAIT / FUTEX_WAKE) on the mapped word, without FUTEX_PRIVATE_FLAG (the waker is
  another process; a shared futex is keyed by the page, not the address space).
- macOS: `__ulock_wait` / `__ulock_wake` with UL_COMPARE_AND_WAIT_SHARED, the same contract.
- Windows: WaitOnAddress works within one process only, so a named auto-reset event per word stands
  in: it is not tied to the word's value, but it keeps a wake that finds no sleeper (`sticky`), so a
  wake between the reader's last look and its wait is not lost either.
- Elsewhere (or when the call is missing): `None`; the caller polls.

Word waits (futex, ulock) return early when the word no longer holds the expected value, when woken,
on a signal, and sometimes for no reason: callers look again and wait again until their deadline.
"""

from __future__ import annotations

import ctypes
import logging
import math
import platform
import sys
from typing import Protocol

logger = logging.getLogger(__name__)

FUTEX_WAIT, FUTEX_WAKE = 0, 1  # without FUTEX_PRIVATE_FLAG (128): the waker is another process
SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "loongarch64": 98,
             "i386": 240, "i686": 240, "armv7l": 240, "ppc64le": 221, "ppc64": 221, "s390x": 238}
UL_COMPARE_AND_WAIT_SHARED = 3
ULF_WAKE_ALL = 0x100
ULF_NO_ERRNO = 0x01000000
INT_MAX = 2**31 - 1


class SharedWait(Protocol):
    sticky: bool  # a wake that finds no sleeper ends the next wait (an event); False: it is lost (a word)

    def wait(self, expected: int, timeout_s: float) -> None:
        """Sleep up to `timeout_s` while the word holds `expected` (or until woken). May return early."""

    def wake(self) -> None:
        """Wake every sleeper on the word. Cheap when none sleeps."""

    def close(self) -> None:
        """Let go of what the waiter holds (not the memory: its owner unmaps that)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    sticky = False

    def __init__(self, libc: ctypes.CDLL, nr: int, address: int):
        self._syscall, self._nr, self._addr = libc.syscall, ctypes.c_long(nr), ctypes.c_void_p(address)

    def wait(self, expected: int, timeout_s: float) -> None:
        sec = int(timeout_s)
        ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
        # CDLL calls release the GIL: other threads run while this one sleeps in the kernel
        self._syscall(self._nr, self._addr, FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)

    def wake(self) -> None:
        self._syscall(self._nr, self._addr, FUTEX_WAKE, INT_MAX, None, None, 0)

    def close(self) -> None:
        pass


class _ULock:
    sticky = False

    def __init__(self, lib: ctypes.CDLL, address: int):
        self._wait, self._wake = getattr(lib, "__ulock_wait"), getattr(lib, "__ulock_wake")
        self._wait.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32]
        self._wake.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
        self._addr = address

    def wait(self, expected: int, timeout_s: float) -> None:
        us = min(max(1, math.ceil(timeout_s * 1e6)), 2**32 - 1)  # 0 would mean "forever"
        self._wait(UL_COMPARE_AND_WAIT_SHARED | ULF_NO_ERRNO, self._addr, expected, us)

    def wake(self) -> None:
        self._wake(UL_COMPARE_AND_WAIT_SHARED | ULF_WAKE_ALL | ULF_NO_ERRNO, self._addr, 0)

    def close(self) -> None:
        pass


class _NamedEvent:
    sticky = True
    SYNCHRONIZE, EVENT_MODIFY_STATE = 0x00100000, 0x0002

    def __init__(self, name: str, create: bool):
        from ctypes import wintypes

        k = ctypes.WinDLL("kernel32", use_last_error=True)
        k.CreateEventW.argtypes = [ctypes.c_void_p, wintypes.BOOL, wintypes.BOOL, wintypes.LPCWSTR]
        k.OpenEventW.argtypes = [wintypes.DWORD, wintypes.BOOL, wintypes.LPCWSTR]
        for f in (k.CreateEventW, k.OpenEventW):
            f.restype = wintypes.HANDLE
        k.SetEvent.argtypes = k.CloseHandle.argtypes = [wintypes.HANDLE]
        k.WaitForSingleObject.argtypes = [wintypes.HANDLE, wintypes.DWORD]
        self._k = k
        self._handle = (k.CreateEventW(None, False, False, name) if create
                        else k.OpenEventW(self.SYNCHRONIZE | self.EVENT_MODIFY_STATE, False, name))
        if not self._handle:
            raise OSError(ctypes.get_last_error(), f"cannot {'create' if create else 'open'} event {name}")

    def wait(self, expected: int, timeout_s: float) -> None:
        self._k.WaitForSingleObject(self._handle, min(math.ceil(timeout_s * 1000), 0xFFFFFFFE))

    def wake(self) -> None:
        self._k.SetEvent(self._handle)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle:
            self._k.CloseHandle(handle)


def _libc() -> ctypes.CDLL | None:
    """The C library already loaded into this process (no library search, which may run a program)."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIB = _libc() if sys.platform != "win32" else None


def backend() -> str:
    """The kernel wait this process uses: "futex", "ulock", "event", or "poll" (none: callers poll)."""
    if sys.platform == "win32":
        return "event"
    if sys.platform.startswith("linux") and _LIB is not None and platform.machine().lower() in SYS_FUTEX:
        return "futex"
    if sys.platform == "darwin" and _LIB is not None and hasattr(_LIB, "__ulock_wait"):
        return "ulock"
    return "poll"


def address_of(buf: memoryview, offset: int) -> int:
    """The address of byte `offset` of a writable mapping (valid for as long as the mapping is)."""
    anchor = ctypes.c_char.from_buffer(buf, offset)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # holds an export of `buf`; the mapping could not be closed while it lives


def shared_wait(buf: memoryview, offset: int, name: str, create: bool) -> SharedWait | None:
    """A waiter on the 4-byte aligned word at `offset` of the shared mapping `buf`. `name` (unique per
    word and machine) names the Windows event; `create`: this side makes it, the other opens it.
    None when this machine has no way to sleep on it (the caller polls)."""
    if offset % 4:
        raise ValueError(f"shared word at offset {offset}: expected a multiple of 4")
    kind = backend()
    try:
        if kind == "futex":
            return _Futex(_LIB, SYS_FUTEX[platform.machine().lower()], address_of(buf, offset))
        if kind == "ulock":
            return _ULock(_LIB, address_of(buf, offset))
        if kind == "event":
            return _NamedEvent("Local\\" + name, create)
    except (OSError, AttributeError, TypeError) as exc:
        logger.warning("no kernel wait for %s (%s): polling instead", name, exc)
    return None
