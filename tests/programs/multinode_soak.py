"""Rank program: back-to-back allreduces for a while, every result checked.

argv: count seconds [marker folder].  Rank 0 decides when to stop (after
`seconds`) and says so inside the allreduce itself, so every rank stops after
the same round.  Writes started-<rank> in the marker folder after the first
round.  Prints one JSON line: {"rounds", "wrong", "error", "message", "longest_s"}
(error None when every round succeeded) and exits 0.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from gradsync.client import Client, GradsyncError

#: Rank 0 adds this to element 0 of its contribution to say "last round".
STOP = 1 << 20


def main() -> int:
    count, seconds = int(sys.argv[1]), float(sys.argv[2])
    markers = sys.argv[3] if len(sys.argv) > 3 else None
    rounds = wrong = 0
    longest = 0.0
    error: tuple[str, str] | None = None
    with Client() as client:
        world = client.world_size
        grads = client.empty(count, np.float32)
        deadline = time.monotonic() + seconds
        while True:
            grads[...] = 1
            last = client.rank == 0 and time.monotonic() >= deadline
            if last:
                grads[0] += STOP
            started = time.monotonic()
            try:
                client.all_reduce(grads)
            except GradsyncError as exc:
                error = (type(exc).__name__, exc.message)
                break
            longest = max(longest, time.monotonic() - started)
            rounds += 1
            stop = grads[0] >= STOP
            grads[0] -= STOP if stop else 0
            wrong += int(grads[0] != world or grads[-1] != world)
            if rounds == 1 and markers:
                with open(f"{markers}/started-{client.rank}", "w") as marker:
                    marker.write("ok")
            if stop:
                break
    print(json.dumps({"rounds": rounds, "wrong": wrong, "longest_s": round(longest, 3),
                      "error": error and error[0], "message": error and error[1]}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
