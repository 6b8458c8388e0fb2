"""`gradsync ping`: ask a daemon who it is, and say so (or why it does not answer)."""

from __future__ import annotations

import os
import sys
import time

from gradsync.client.ping import query
from gradsync.protocol.endpoint import default_endpoint
from gradsync.protocol.errors import DaemonUnavailableError, GradsyncError

#: Between tries of `ping --wait`: a starting daemon binds its socket within ms.
_RETRY_S = 0.05


def ping(daemon: str | None, timeout_s: float, wait_s: float = 0.0) -> int:
    """Print the daemon's identity (exit 0), or why it does not answer (exit 1).

    With `wait_s`, a daemon that does not answer yet (just started, socket not
    bound) is asked again until it answers or `wait_s` has passed; any other
    error (another protocol version) ends the wait at once.
    """
    endpoint = daemon or os.environ.get("GRADSYNC_DAEMON") or default_endpoint()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = query(endpoint, timeout_s)
            break
        except DaemonUnavailableError as exc:
            if time.monotonic() + _RETRY_S < deadline:
                time.sleep(_RETRY_S)
                continue
            waited = f" (waited {wait_s:g}s)" if wait_s > 0 else ""
            print(f"gradsync ping: {exc}{waited}", file=sys.stderr)
            return 1
        except GradsyncError as exc:
            print(f"gradsync ping: {exc}", file=sys.stderr)
            return 1
    print(
        f"gradsyncd {reply.get('version')} (pid {reply.get('pid')}, "
        f"protocol v{reply.get('protocol')}) at {endpoint}"
    )
    return 0
