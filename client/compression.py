"""Which wire format a collective asks for: the call's, else the job's default.

A format named in the call is checked strictly (an int buffer or a `max`
asked to compress is an `InvalidArgumentError`); the job-wide default,
`GRADSYNC_COMPRESSION`, applies only where it can (float32/float64 sum or avg
allreduce and reduce-scatter) and leaves the rest exact, so a job that sets
it keeps its integer allreduces and barriers working.  `auto` (`auto:bf16`,
`auto:fp8`: only that format) lets the daemons compress where it pays
(docs/compression.md); it is checked and applied like a format.
"""

from __future__ import annotations

import dataclasses
import os

from gradsync.protocol.compression import (
    COMPRESSIBLE_DTYPES,
    COMPRESSIBLE_KINDS,
    COMPRESSIBLE_OPS,
    check_compressible,
    is_auto,
    parse_compression,
)
from gradsync.protocol.errors import InvalidArgumentError

ENVIRONMENT = "GRADSYNC_COMPRESSION"
#: "1" turns error feedback on for the job-wide default.
FEEDBACK_ENVIRONMENT = "GRADSYNC_ERROR_FEEDBACK"


@dataclasses.dataclass(frozen=True)
class Compression:
    """A format (None: exact) and whether to feed the rounding residual back."""

    format: str | None = None
    error_feedback: bool = False

    @classmethod
    def parse(cls, compression: str | None, error_feedback: bool = False) -> Compression:
        """A checked choice; `InvalidArgumentError` for an unknown name."""
        chosen = parse_compression(compression)
        if error_feedback and chosen is None:
            raise InvalidArgumentError(
                "error_feedback=True needs a compression (bf16, fp8 or auto)")
        return cls(chosen, bool(error_feedback))


def from_environment() -> Compression:
    """The job-wide default, `GRADSYNC_COMPRESSION` (and `GRADSYNC_ERROR_FEEDBACK`)."""
    name = os.environ.get(ENVIRONMENT) or None
    feedback = os.environ.get(FEEDBACK_ENVIRONMENT, "0") not in ("", "0")
    try:
        return Compression.parse(name, feedback and name not in (None, "none"))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{ENVIRONMENT}={name!r}: {exc.message}") from None


def choose(
    asked: str | None, error_feedback: bool, default: Compression, kind: str, dtype: str,
    op: str | None, on_device: bool = False,
) -> Compression:
    """The choice for one collective: `asked` strictly, else `default` where it
    applies.  Device buffers stay exact (the codecs are the host's): asked for
    `auto` there, they simply run uncompressed."""
    if asked is not None or error_feedback:
        chosen = Compression.parse(asked, error_feedback)
        check_compressible(chosen.format, kind, dtype, op, chosen.error_feedback)
        if on_device and is_auto(chosen.format):
            return Compression()
        if chosen.format is not None and on_device:
            raise InvalidArgumentError(
                f"{kind}: compression={asked!r} is for host buffers; device buffers are "
                "reduced exactly")
        return chosen
    if (default.format is not None and kind in COMPRESSIBLE_KINDS and not on_device
            and dtype in COMPRESSIBLE_DTYPES and op in COMPRESSIBLE_OPS):
        return default
    return Compression()
