"""`auto` compression: whether, and in which format, a job's daemons compress.

A compressed slice costs its coding (an encode at the sender, a decode at the
receiver) and saves wire time.  Per byte of the buffer a link of L bytes/s
takes 1/L uncompressed, and at most r/L + 1/C compressed, with r the format's
wire bytes per buffer byte and C the rate at which the daemon encodes and
decodes with all its codec lanes.  Coding overlaps the wire in a pipeline, but
it sits on every hop's path (a slice is decoded, added and re-encoded before it
is forwarded) and shares the cores with the transfers, so the sum is what is
counted on: the estimated speed-up is 1 / (r + L/C), and a format is chosen
only where that is at least `MIN_SPEEDUP` — in words, where the link is well
below the codec's rate.  Of the formats allowed, the best estimate wins, but
bf16 (twice fp8's precision) wherever fp8 would not be `FP8_MARGIN` faster.

Where every member reaches its peers over this host's own addresses
(loopback), the "link" is memory copies on the very cores that would code, and
the estimate says nothing: nothing is compressed (measured, benchmarks/
RESULTS.md, "Compression": bf16 and fp8 slowed a 127.0.0.1 allreduce).

Every member decides alike from agreed inputs: the link rate the `auto`
algorithm prices with (the formation's medians of the probes, then each
epoch's agreed figures, core/auto.py), the slowest member's codec rates,
whether all are loopback-only and whether all had measured their links when
they announced the job (membership.py; a job announced before its links were
probed prices with defaults, which say nothing about the link: none).
Pure: no sockets, no clock.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from gradsync.protocol.compression import FP8_BLOCK

__all__ = ["FP8_MARGIN", "MIN_SPEEDUP", "CompressionChoice", "choose_format", "rate_key",
           "wire_ratio"]

#: A format must be estimated at least this much faster than none: the estimate
#: leaves out per-slice costs and the copies compressed slices cannot skip.
MIN_SPEEDUP = 1.25
#: fp8 replaces bf16 only where estimated this much faster.
FP8_MARGIN = 1.1


def rate_key(fmt: str, dtype: str) -> str:
    """The name of a codec rate: the format for float32 buffers, `fmt/dtype` else."""
    return fmt if dtype == "float32" else f"{fmt}/{dtype}"


def wire_ratio(fmt: str, itemsize: int) -> float:
    """Wire bytes per buffer byte of `fmt` for elements of `itemsize` bytes."""
    if fmt == "bf16":
        return 2 / itemsize
    return (1 + 4 / FP8_BLOCK) / itemsize


@dataclasses.dataclass(frozen=True)
class CompressionChoice:
    """What `auto` chose (`format`, None: uncompressed), and its basis."""

    format: str | None
    #: Why, in words (shown by `gradsync stats`).
    reason: str
    #: The link rate (buffer bytes/s uncompressed) and the codec rates weighed.
    link_Bps: float
    codec_Bps: tuple[tuple[str, float], ...]
    #: Estimated speed-up of each allowed format that could be priced.
    speedups: tuple[tuple[str, float], ...]


@functools.lru_cache(maxsize=256)
def _choose(
    allowed: tuple[str, ...], dtype: str, itemsize: int, link_Bps: float,
    codec_Bps: tuple[tuple[str, float], ...], loopback: bool, links_measured: bool,
) -> CompressionChoice:
    rates = dict(codec_Bps)

    def none(reason: str, speedups: tuple[tuple[str, float], ...] = ()) -> CompressionChoice:
        return CompressionChoice(None, reason, link_Bps, codec_Bps, speedups)

    if loopback:
        return none("every member daemon reaches its peers on this host (loopback): the "
                    "link is this host's memory, which coding would take cores from")
    if not link_Bps > 0 or not links_measured:
        return none("no link rate measured (a member announced the job before it had "
                    "measured its links)" if link_Bps > 0 else "no link rate measured")
    speedups = []
    for fmt in allowed:
        rate = rates.get(rate_key(fmt, dtype), 0.0)
        if rate > 0:
            speedups.append((fmt, 1 / (wire_ratio(fmt, itemsize) + link_Bps / rate)))
    if not speedups:
        return none(f"no codec rate for {'/'.join(allowed)} of {dtype} from every member")
    priced = tuple(speedups)
    best, estimate = max(speedups, key=lambda item: item[1])
    link = f"link {link_Bps / 1e9:.3g} GB/s"
    if estimate < MIN_SPEEDUP:
        return none(f"{link} is too fast for the codec ({rate_key(best, dtype)} "
                    f"{rates[rate_key(best, dtype)] / 1e9:.3g} GB/s): {best} would be "
                    f"{estimate:.2f}x, below {MIN_SPEEDUP}x", priced)
    bf16 = dict(speedups).get("bf16", 0.0)
    if best == "fp8" and bf16 >= MIN_SPEEDUP and estimate < FP8_MARGIN * bf16:
        best, estimate = "bf16", bf16
    return CompressionChoice(
        best, f"{link} is below the codec's {rates[rate_key(best, dtype)] / 1e9:.3g} GB/s: "
        f"{best} estimated {estimate:.2f}x", link_Bps, codec_Bps, priced)


def choose_format(
    allowed: tuple[str, ...], dtype: str, itemsize: int, link_Bps: float,
    codec_Bps: Mapping[str, float], loopback: bool, links_measured: bool = True,
) -> CompressionChoice:
    """The format (or none) for a collective of `dtype` buffers, of the `allowed`
    ones, given the agreed link rate, the members' codec rates (by `rate_key`;
    the slowest member's), whether every member is loopback-only and whether
    every member had measured its links.  Remembered: every collective of a job
    asks again with the same figures."""
    return _choose(tuple(allowed), dtype, itemsize, float(link_Bps),
                   tuple(sorted(codec_Bps.items())), bool(loopback), bool(links_measured))
