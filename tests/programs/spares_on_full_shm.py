"""A checkpoint store whose spares are still being reserved when /dev/shm fills up.

Run in a mount namespace with a small tmpfs as /dev/shm
(tests/test_checkpoint_store.py).  The store's background thread is held busy
while a commit asks it for two spares; then a file fills /dev/shm, the thread
is let go and their reservations fail.  The next put must drop them and fail
with a clear error (no crash, no SIGBUS, no leak); once the file is gone, the
same put succeeds.  Prints one JSON line of what happened.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading

from gradsync.daemon.backends import Buffers
from gradsync.daemon.checkpoints import CheckpointStore
from gradsync.protocol.errors import ShmExhaustedError

PAGE = 4096


def main() -> None:
    gate = threading.Event()
    happened: dict[str, object] = {}
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        background.submit(gate.wait, 60)
        store = CheckpointStore(Buffers(1 << 30), kept=1, background=background)
        store.put("j", 1, 0, "data", 16 * PAGE)
        store.commit("j", 1, ((0, "data"),))
        happened["spares"] = len(store.spares[("j", 0, "data")])
        free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
        with open("/dev/shm/filler", "wb") as filler:
            os.posix_fallocate(filler.fileno(), 0, free)
        gate.set()
        try:
            store.put("j", 2, 0, "data", 16 * PAGE)
        except ShmExhaustedError as exc:
            happened["error"] = str(exc)
        happened["spares_after"] = len(store.spares)
        os.unlink("/dev/shm/filler")
        slab = store.put("j", 2, 0, "data", 16 * PAGE)
        slab.handle.mapping[:4] = b"done"  # its pages are there: no SIGBUS
        store.commit("j", 2, ((0, "data"),))
        happened["committed"] = [c.step for c in store.complete("j")]
        store.release_all()
        happened["left"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(happened))


if __name__ == "__main__":
    main()
