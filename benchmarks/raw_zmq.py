"""Raw pyzmq TCP throughput between the nodes of a run: the ceiling for the daemons' links.

One process per node (started by `interdaemon.py`, inside the node's namespace
when there is one).  Node i binds a ROUTER on its endpoint and connects a
DEALER to node i+1 (mod M), as gradsync's peer links do, and sends 1 MiB
frames zero-copy (`copy=False`) from one buffer; receivers take frames
`copy=False` too.  Two patterns:

* one way: node 0 streams VOLUME bytes to node 1; node 1 answers once all
  arrived.  Time = send start to answer, per round.
* ring exchange: every node sends VOLUME bytes to the next node while it
  receives VOLUME bytes from the previous one: the traffic pattern of a ring
  allreduce step, without the reduction and without steps.  Time per round
  on each node; the driver takes the slowest node per round.  A small volume
  (one 4 KiB frame) gives the floor of one step's latency instead; small
  volumes get SMALL_ROUNDS_FACTOR times more rounds.

Writes `{"index", "stream_s": {volume: [s, ...]}, "ring_s": {volume: [...]}}`
as JSON to --out.  Not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import zmq

FRAME_BYTES = 1024 * 1024
SMALL_ROUNDS_FACTOR = 25
DATA, GO, ACK = b"d", b"g", b"a"


class Node:
    def __init__(self, index: int, endpoints: list[str], timeout_s: float) -> None:
        self.index = index
        self.size = len(endpoints)
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.router.bind(endpoints[index])
        self.dealer = self.context.socket(zmq.DEALER)
        # The next node may still be receiving our last round when we are done: flush it.
        self.dealer.setsockopt(zmq.LINGER, int(timeout_s * 1000))
        self.dealer.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.dealer.setsockopt(zmq.ROUTING_ID, str(index).encode())
        self.dealer.connect(endpoints[(index + 1) % self.size])

    def close(self) -> None:
        self.router.close(0)
        self.dealer.close()  # lingers until what is queued has left
        self.context.term()

    def sync(self) -> None:
        """Ring handshake: tell the next node we are here, hear it from the previous one.

        The first one also waits for the TCP connections to come up (zmq
        queues the message until then).
        """
        self.dealer.send_multipart([GO])
        self._recv_kind(GO)

    def _recv_kind(self, kind: bytes) -> list[zmq.Frame]:
        frames = self.router.recv_multipart(copy=False)
        if frames[1].bytes != kind:
            raise RuntimeError(f"expected {kind!r}, got {frames[1].bytes!r}")
        return frames

    def _send_volume(self, data: memoryview) -> None:
        for start in range(0, data.nbytes, FRAME_BYTES):
            self.dealer.send_multipart([DATA, data[start : start + FRAME_BYTES]], copy=False)

    def _receive_volume(self, nbytes: int) -> None:
        got = 0
        while got < nbytes:
            frames = self.router.recv_multipart(copy=False)
            if frames[1].bytes != DATA:
                raise RuntimeError(f"expected data, got {frames[1].bytes!r}")
            got += len(frames[2].buffer)

    def stream(self, data: memoryview, rounds: int) -> list[float]:
        """Node 0 sends `data` to node 1 `rounds` times (plus a warm-up); its times."""
        times = []
        for _ in range(rounds + 1):
            if self.index == 0:
                start = time.perf_counter()
                self._send_volume(data)
                self.dealer.recv_multipart()  # node 1's answer
                times.append(time.perf_counter() - start)
            elif self.index == 1:
                self._receive_volume(data.nbytes)
                self.router.send_multipart([b"0", ACK])  # to node 0's DEALER, by routing id
        return times[1:]

    def ring(self, data: memoryview, rounds: int) -> list[float]:
        """Send `data` to the next node while receiving as much from the previous one."""
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            self._send_volume(data)  # queued: libzmq's I/O thread sends while we receive
            self._receive_volume(data.nbytes)
            times.append(time.perf_counter() - start)
        return times[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--endpoints", required=True, help="tcp://HOST:PORT per node, in order")
    parser.add_argument("--stream-bytes", default="", help="volumes for the one-way stream")
    parser.add_argument("--ring-bytes", default="", help="volumes for the ring exchange")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    endpoints = args.endpoints.split(",")
    streams = [int(v) for v in args.stream_bytes.split(",") if v]
    rings = [int(v) for v in args.ring_bytes.split(",") if v]
    data = memoryview(bytearray(max([*streams, *rings, FRAME_BYTES])))
    data[: data.nbytes] = os.urandom(16) * (data.nbytes // 16) + b"\0" * (data.nbytes % 16)
    node = Node(args.index, endpoints, args.timeout_s)
    result: dict[str, Any] = {"index": args.index, "stream_s": {}, "ring_s": {}}
    try:
        node.sync()
        for volume in streams:
            node.sync()
            result["stream_s"][str(volume)] = node.stream(data[:volume], args.rounds)
        for volume in rings:
            node.sync()
            rounds = args.rounds * (SMALL_ROUNDS_FACTOR if volume < FRAME_BYTES else 1)
            result["ring_s"][str(volume)] = node.ring(data[:volume], rounds)
        node.sync()
    finally:
        node.close()
    with open(args.out + ".tmp", "w") as out:
        json.dump(result, out)
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
