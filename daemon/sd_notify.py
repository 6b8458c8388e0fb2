"""The systemd notification protocol (sd_notify), without libsystemd.

A datagram of `KEY=VALUE` lines to the socket named by `$NOTIFY_SOCKET` (a
path, or an abstract name written with a leading `@`).  Everything is a no-op
when the variable is unset, so the daemon behaves the same outside systemd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("gradsync.daemon.systemd")


class Notifier:
    """Sends state changes (`READY=1`, `STATUS=…`, `WATCHDOG=1`, `STOPPING=1`) to systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if address.startswith("@"):
            self._address = b"\0" + address[1:].encode()
        elif address.startswith("/"):
            self._address = address
        elif address:
            log.warning("ignoring NOTIFY_SOCKET=%r: not a path or an @abstract name", address)
        self._socket: socket.socket | None = None
        if self._address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_s = _watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, *lines: str) -> None:
        """Send one datagram; failures are logged, never raised (systemd may be gone)."""
        if self._socket is None or self._address is None:
            return
        try:
            self._socket.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self._address, exc.strerror)

    def close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
            self._socket = None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between `WATCHDOG=1` pings: half of `WATCHDOG_USEC`, if it is meant for us."""
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        interval = int(usec) / 1e6 / 2
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    return interval if interval > 0 else None
