"""Wire compression of the inter-daemon phase: the format names and who may ask.

Between daemons a compressed allreduce (or reduce-scatter) sends every slice
encoded: `bf16` (bfloat16, round to nearest even, 2 bytes an element) or `fp8`
(float8 e4m3, one float32 power-of-two scale per block of `FP8_BLOCK`
elements, about 1.02 bytes an element).  Each hop decodes to the buffer's own
dtype and adds there; the intra-node phase stays exact.  The codecs are the
daemon's (daemon/backends/wire_codec.py); what both the client and the daemon
must agree on is here: the names, and which collectives, dtypes and ops they
apply to.  `auto` (or `auto:bf16`, `auto:fp8`, naming the one format allowed)
leaves the format to the daemons, which compress only where the link is slower
than their codec (daemon/core/compression_policy.py); what travels between
daemons is always the format they chose.  No numpy on import (the CLI reaches
this through requests.py).
"""

from __future__ import annotations

from typing import Any

from gradsync.protocol.errors import InvalidArgumentError

#: The wire formats ("none" and None: uncompressed).
COMPRESSIONS: tuple[str, ...] = ("bf16", "fp8")
#: The daemons choose: any format (`auto`), or one named format or none.
AUTO = "auto"
AUTO_CHOICES: tuple[str, ...] = (AUTO, *(f"{AUTO}:{name}" for name in COMPRESSIONS))
#: Elements per fp8 block, each with its own float32 scale (see wire_codec.py).
FP8_BLOCK = 256
#: Collectives whose inter-daemon phase can be compressed.
COMPRESSIBLE_KINDS = frozenset({"allreduce", "reduce_scatter"})
#: Element types and reductions a compressed collective takes: a float sum.
COMPRESSIBLE_DTYPES = frozenset({"float32", "float64"})
COMPRESSIBLE_OPS = frozenset({"sum", "avg"})


def parse_compression(name: Any) -> str | None:
    """The format `name` asks for (None for none; an `AUTO_CHOICES` name as it is),
    or `InvalidArgumentError`."""
    if name is None or name == "none" or name == "":
        return None
    if isinstance(name, str) and (name in COMPRESSIONS or name in AUTO_CHOICES):
        return name
    shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:79] + "…"
    raise InvalidArgumentError(
        f"unknown compression {shown}; expected one of "
        f"{', '.join((*COMPRESSIONS, *AUTO_CHOICES))} or none"
    )


def is_auto(name: str | None) -> bool:
    """Whether `name` (a parsed compression) leaves the format to the daemons."""
    return name is not None and name in AUTO_CHOICES


def allowed_formats(name: str) -> tuple[str, ...]:
    """The formats an `AUTO_CHOICES` name lets the daemons pick from."""
    return COMPRESSIONS if name == AUTO else (name.partition(":")[2],)


def check_compressible(
    compression: str | None, kind: str, dtype: str, op: str | None, error_feedback: bool = False
) -> None:
    """Refuse compression where it has no meaning: only float32/float64 sum/avg
    allreduce and reduce-scatter compress (an integer or a max would not be the
    value asked for once rounded); error feedback needs a format."""
    if compression is None:
        if error_feedback:
            raise InvalidArgumentError(
                f"{kind}: error_feedback=True needs a compression (one of "
                f"{', '.join((*COMPRESSIONS, *AUTO_CHOICES))})")
        return
    if kind not in COMPRESSIBLE_KINDS:
        raise InvalidArgumentError(
            f"{kind} cannot be compressed; compression={compression!r} applies to "
            f"{' and '.join(sorted(COMPRESSIBLE_KINDS))}")
    if dtype not in COMPRESSIBLE_DTYPES:
        raise InvalidArgumentError(
            f"{kind} of {dtype} with compression={compression!r}: only "
            f"{' and '.join(sorted(COMPRESSIBLE_DTYPES))} buffers compress")
    if op not in COMPRESSIBLE_OPS:
        raise InvalidArgumentError(
            f"{kind} with op={op!r} and compression={compression!r}: only "
            f"{' and '.join(sorted(COMPRESSIBLE_OPS))} compress")
