"""Leave the job cleanly when a program exits without `destroy_process_group`.

Many programs (and accelerate, and plain scripts) never destroy their process
groups; gloo says nothing then.  Without this, the daemon sees the socket drop
and warns that the rank died.  At interpreter exit every live group shuts
down, so the daemon logs an orderly leave instead.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import Protocol

__all__ = ["leave_at_exit"]


class _Closable(Protocol):
    def shutdown(self) -> None: ...


_live: weakref.WeakSet[_Closable] = weakref.WeakSet()


def leave_at_exit(group: _Closable) -> None:
    """Shut `group` down at interpreter exit, if it is still alive then."""
    _live.add(group)


@atexit.register
def _shut_down_all() -> None:
    for group in list(_live):
        with contextlib.suppress(Exception):
            group.shutdown()
