"""Types of the compiled checkpoint copy (client/_stream_copy.c)."""

from typing import Any

from numpy.typing import NDArray
from typing_extensions import Buffer

def copy(destination: Buffer | NDArray[Any], source: Buffer | NDArray[Any], /) -> None: ...
