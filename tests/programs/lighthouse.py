"""torchft's Lighthouse as a process of its own (for one inside a network namespace).

Usage: lighthouse.py PORT MIN_REPLICAS HEARTBEAT_TIMEOUT_MS
Serves on [::]:PORT until SIGTERM; prints "ready" once up.
"""

from __future__ import annotations

import signal
import sys
import threading

from torchft._torchft import LighthouseServer


def main() -> None:
    port, replicas, heartbeat_ms = (int(arg) for arg in sys.argv[1:4])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # A short join timeout: a quorum waits 0.1 s (not 60 s) for a heartbeating replica.
    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=replicas, join_timeout_ms=100,
                              quorum_tick_ms=20, heartbeat_timeout_ms=heartbeat_ms)
    print("ready", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()


if __name__ == "__main__":
    main()
