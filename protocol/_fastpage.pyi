"""Types of the compiled publish-and-spin and page lock (protocol/_fastpage.c)."""

from typing import Any

import numpy as np
from typing_extensions import Buffer

REFUSED: int
WAITING: int
MISMATCH: int
REDUCED: int
BUSY: int
MUTEX_BYTES: int

class Page:
    def __init__(self, page: Buffer, layout: Buffer, fd: int) -> None: ...
    def publish(
        self, rank: int, index: int, key: int, codes: int, count: int,
        data: Buffer | np.ndarray[Any, Any], reduction: int, spin_ns: int,
        waker_spin_ns: int, reuse_key: int = -1, /,
    ) -> list[int] | int: ...
    def lock(self) -> None: ...
    def try_lock(self) -> bool: ...
    def unlock(self) -> None: ...
    def init_lock(self) -> None: ...
    def close(self) -> None: ...
