"""Types of the compiled publish-and-spin (protocol/_fastpage.c)."""

from typing_extensions import Buffer

REFUSED: int
WAITING: int
MISMATCH: int
REDUCED: int
BUSY: int

def publish(
    page: Buffer, layout: Buffer, fd: int, rank: int, index: int, key: int, codes: int,
    count: int, data: Buffer, reduction: int, spin_ns: int, waker_spin_ns: int,
    reuse_key: int = -1, /,
) -> list[int] | int: ...
