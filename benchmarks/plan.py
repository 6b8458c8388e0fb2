"""What to measure: message sizes, ops per sample, sample counts, contenders.

Shared by the driver (`allreduce.py`) and the rank program (`rank_worker.py`),
so both ends agree on the method without passing it all on command lines.
"""

from __future__ import annotations

import dataclasses
import re

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

DEFAULT_SIZES = (4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB)
DEFAULT_NPROCS = (2, 4)

#: Contenders in table order: (key, column title).
CONTENDERS = (
    ("gradsync-empty", "gradsync empty()"),
    ("gradsync-numpy", "gradsync numpy"),
    ("gloo", "torch gloo"),
    ("mpi", "Open MPI"),
)
CONTENDER_KEYS = tuple(key for key, _ in CONTENDERS)
TITLES = dict(CONTENDERS)

#: The size whose per-op latency distribution is also recorded.
LATENCY_SIZE = 4 * KIB

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": KIB, "m": MIB, "g": GIB}


def parse_size(text: str) -> int:
    """'4KiB', '16M', '1048576' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 4KiB, 16MiB, 1048576)")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _UNITS[unit]


def parse_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(parse_size(part) for part in text.split(",") if part.strip())
    if not sizes:
        raise ValueError("no sizes given")
    bad = [s for s in sizes if s <= 0 or s % 4]
    if bad:
        raise ValueError(f"sizes must be positive multiples of 4 bytes (float32): {bad}")
    return sizes


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def ops_per_sample(nbytes: int) -> int:
    """k back-to-back ops per sample, as in BASELINES.md: 100 / 10 / 1."""
    if nbytes <= 64 * KIB:
        return 100
    if nbytes <= MIB:
        return 10
    return 1


@dataclasses.dataclass(frozen=True)
class SamplePolicy:
    """How many samples: enough to fill `budget_s`, within [min_samples, max_samples]."""

    budget_s: float = 1.5
    min_samples: int = 10
    max_samples: int = 100
    latency_budget_s: float = 1.0
    latency_min_ops: int = 200
    latency_max_ops: int = 2000

    def samples_for(self, sample_s: float) -> int:
        wanted = int(self.budget_s / max(sample_s, 1e-9))
        return max(self.min_samples, min(self.max_samples, wanted))

    def latency_ops_for(self, op_s: float) -> int:
        wanted = int(self.latency_budget_s / max(op_s, 1e-9))
        return max(self.latency_min_ops, min(self.latency_max_ops, wanted))
