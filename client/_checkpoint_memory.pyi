"""Types of the checkpoint writer's compiled memory work (client/_checkpoint_memory.c)."""

import mmap
from typing import Any

from numpy.typing import NDArray
from typing_extensions import Buffer

def copy(destination: Buffer | NDArray[Any], source: Buffer | NDArray[Any], /) -> None: ...
def populate(mapping: mmap.mmap, step: int, /) -> bool: ...
def drop_pages(mapping: mmap.mmap, step: int, /) -> None: ...
