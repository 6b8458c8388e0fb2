"""Linux futexes on a word of shared memory: sleep until the word changes.

The fast path's waiters sleep here once a short spin has not seen their peers
(so a rank waiting for a late peer, and the daemon, use no CPU), and whoever
changes the fast page's bell wakes them: one system call each way, no thread,
no socket.  Process-shared futexes (no FUTEX_PRIVATE_FLAG) on a MAP_SHARED
mapping work across processes.  Only x86-64 Linux is supported, where the
syscall number is fixed and stores are seen in order by other cores (the
fast path's publication relies on that, see protocol/fast_path.py).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import platform
import sys

_SYS_FUTEX_X86_64 = 202
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """Whether this machine runs futexes here (x86-64 Linux)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


class Futex:
    """One 32-bit word of a shared mapping, to wait on and to wake."""

    def __init__(self, mapping: mmap.mmap, offset: int) -> None:
        if not supported():
            raise OSError(errno.ENOSYS, "futexes are used on x86-64 Linux only")
        if offset % 4:
            raise ValueError(f"a futex word must be 4-byte aligned, got offset {offset}")
        self._word = ctypes.c_uint32.from_buffer(mapping, offset)
        self._address = ctypes.addressof(self._word)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = self._libc.syscall
        self._syscall.restype = ctypes.c_long

    @property
    def value(self) -> int:
        return int(self._word.value)

    def wait(self, expected: int, timeout_s: float) -> None:
        """Sleep while the word equals `expected`, at most `timeout_s` (or until woken).

        Returns at once if the word already differs; spurious returns are the
        caller's to handle (it re-reads the state it waits for).
        """
        seconds = max(0.0, timeout_s)
        spec = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
        self._syscall(
            _SYS_FUTEX_X86_64, ctypes.c_void_p(self._address), _FUTEX_WAIT,
            ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(spec), None, 0,
        )

    def wake_all(self) -> None:
        self._syscall(
            _SYS_FUTEX_X86_64, ctypes.c_void_p(self._address), _FUTEX_WAKE, _WAKE_ALL,
            None, None, 0,
        )

    def close(self) -> None:
        """Let go of the mapping (an mmap cannot close while this word points into it)."""
        del self._word
