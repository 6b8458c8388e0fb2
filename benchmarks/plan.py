"""What to measure: message sizes, ops per sample, sample counts, contenders.

Shared by the drivers (`allreduce.py`, `interdaemon.py`) and the rank program
(`rank_worker.py`), so both ends agree on the method without passing it all on
command lines.
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
    ("gradsync-torch", "torch on gradsync"),
    ("gloo", "torch gloo"),
    ("mpi", "Open MPI"),
)
CONTENDER_KEYS = tuple(key for key, _ in CONTENDERS)

#: Algorithms between daemons, as `Client.all_reduce(algorithm=...)` names them.
ALGORITHMS = ("ring", "tree", "rhd", "star", "auto")
FIXED_ALGORITHMS = ALGORITHMS[:-1]


def algorithm_key(algorithm: str, label: str = "gradsync") -> str:
    """Contender key of gradsync with one inter-daemon algorithm: `gradsync-ring`."""
    return f"{label}-{algorithm}"


#: Inter-daemon contenders (`interdaemon.py`) in table order.
INTERDAEMON_CONTENDERS = (
    *((algorithm_key(a), f"gradsync {a}") for a in ALGORITHMS),
    ("gloo", "torch gloo"),
)
#: gradsync ring over CURVE-encrypted links (`interdaemon.py`'s encryption row).
CURVE_CONTENDERS = (
    (algorithm_key("ring", "gradsync-insecure"), "gradsync ring, --insecure"),
    (algorithm_key("ring", "gradsync-curve"), "gradsync ring, CURVE"),
)
TITLES = {**dict(CONTENDERS), **dict(INTERDAEMON_CONTENDERS), **dict(CURVE_CONTENDERS)}

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


def ops_per_sample(nbytes: int, small: int = 100, medium: int = 10) -> int:
    """k back-to-back ops per sample, as in BASELINES.md: 100 / 10 / 1.

    `small` up to 64 KiB, `medium` up to 1 MiB, 1 above.
    """
    if nbytes <= 64 * KIB:
        return small
    if nbytes <= MIB:
        return medium
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
    #: k (back-to-back ops per sample) up to 64 KiB and up to 1 MiB; 1 above.
    ops_small: int = 100
    ops_medium: int = 10

    def ops_for(self, nbytes: int) -> int:
        return ops_per_sample(nbytes, self.ops_small, self.ops_medium)

    def samples_for(self, sample_s: float) -> int:
        wanted = int(self.budget_s / max(sample_s, 1e-9))
        return max(self.min_samples, min(self.max_samples, wanted))

    def latency_ops_for(self, op_s: float) -> int:
        wanted = int(self.latency_budget_s / max(op_s, 1e-9))
        return max(self.latency_min_ops, min(self.latency_max_ops, wanted))
