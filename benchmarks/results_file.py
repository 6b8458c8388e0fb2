"""RESULTS.md: machine, command, tables, diagnostics, and the hand-written notes.

The "what limits it" notes are written by a person from the numbers; a rerun
keeps whatever stands between the notes markers of the existing file, so
regenerating the tables never loses them (check they still match, though).

The file holds the single-node report (`allreduce.py`) as its main body, and
further reports in marked sections (`interdaemon.py`: section "interdaemon").
`write_section` rewrites one of them and keeps the others.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

from benchmarks.plan import SamplePolicy, format_size
from benchmarks.report import (
    ContenderRun,
    details_table,
    latency_table,
    load_table,
    problems,
    results_table,
    target_lines,
)

NOTES_BEGIN = "<!-- notes:begin (hand-written; kept when the file is regenerated) -->"
NOTES_END = "<!-- notes:end -->"
_NOTES_PLACEHOLDER = (
    "_Not written yet: read the tables and diagnostics above and say what bounds each "
    "contender (memory bandwidth, socket round trips, cores shared by ranks and daemon)._"
)


@dataclasses.dataclass
class RunDescription:
    command: str
    started: str
    duration_s: float
    machine: dict[str, str]
    probes: dict[str, float]
    round_trips: dict[str, tuple[float, float]]
    probe_background: float | None
    daemon_command: str | None
    mpirun_command: str | None
    daemon_notes: list[str]
    load_average: str
    policy: SamplePolicy


def existing_notes(
    path: str, begin_marker: str = NOTES_BEGIN, end_marker: str = NOTES_END
) -> str | None:
    """The notes block of an existing RESULTS.md, without its markers."""
    if not os.path.exists(path):
        return None
    with open(path) as source:
        text = source.read()
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin < 0 or end < begin:
        return None
    return text[begin + len(begin_marker) : end].strip("\n")


# -- sections -----------------------------------------------------------------

_SECTION = re.compile(
    r"<!-- section:(?P<name>[A-Za-z0-9_-]+):begin[^>]*-->\n?(?P<body>.*?)"
    r"<!-- section:(?P=name):end -->\n?",
    re.DOTALL,
)


def section_markers(name: str, writer: str) -> tuple[str, str]:
    return (
        f"<!-- section:{name}:begin (written by {writer}; the rest of this file is kept "
        "when this section is rewritten) -->",
        f"<!-- section:{name}:end -->",
    )


def split_sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The main body (text outside any section) and the marked sections, in file order."""
    sections = [(m.group("name"), m.group(0)) for m in _SECTION.finditer(text)]
    return _SECTION.sub("", text), sections


def write_section(path: str, name: str | None, text: str, writer: str = "") -> None:
    """Write `text` as section `name` of `path` (None: the main body); keep the rest.

    A section is replaced where it stands, or appended at the end; the main
    body stays first.
    """
    existing = ""
    if os.path.exists(path):
        with open(path) as source:
            existing = source.read()
    body, sections = split_sections(existing)
    if name is None:
        body = text
    else:
        begin, end = section_markers(name, writer or "a benchmark")
        block = f"{begin}\n{text.strip(chr(10))}\n{end}\n"
        for index, (other, _) in enumerate(sections):
            if other == name:
                sections[index] = (name, block)
                break
        else:
            sections.append((name, block))
    parts = [body.rstrip("\n") + "\n"] if body.strip() else []
    parts += [block for _, block in sections]
    with open(path + ".tmp", "w") as out:
        out.write("\n".join(parts))
    os.replace(path + ".tmp", path)


def render(
    run: RunDescription,
    runs: Sequence[ContenderRun],
    all_runs: Sequence[ContenderRun],
    sizes: Sequence[int],
    nprocs: Sequence[int],
    notes: str | None,
) -> str:
    """The whole file; `runs` are the reported repeats, `all_runs` every repeat."""
    out: list[str] = []
    add = out.append
    add("# Allreduce benchmark: gradsync vs torch gloo vs Open MPI\n")
    add(
        f"Recorded {run.started}, {run.duration_s:.0f} s in all. Reproduce from the "
        "repository root (venv active):\n"
    )
    add(f"```\n{run.command}\n```\n")
    add("## Machine\n")
    for label, value in run.machine.items():
        add(f"- {label}: {value}")
    add("")
    add("## Method\n")
    add(
        "float32 sum allreduce, in place, N ranks on this one node. Per size: a correctness "
        "check (rank r contributes (r + 1) + i mod 13; every element of the result is "
        "compared with the exact sum), a warm-up batch, a timed batch that sets the sample "
        f"count (enough samples for about {run.policy.budget_s:g} s, at least "
        f"{run.policy.min_samples}, at most {run.policy.max_samples}), then samples of "
        "k back-to-back ops (k = 100 up to 64 KiB, 10 up to 1 MiB, 1 above) with a barrier "
        "before each, and the correctness check again. time = median over samples of the "
        "slowest rank's sample time / k; algbw = bytes / time; busbw = algbw * 2(N-1)/N. "
        "The per-op latency is one op after a barrier, slowest rank, median and p99 over "
        "the ops timed. gradsync's barrier is a one-element allreduce (no barrier "
        "collective yet); gloo uses `dist.barrier()`, MPI `Barrier()`. All ranks get "
        "`OMP_NUM_THREADS=1` (as torchrun does).\n"
    )
    add("- gradsync empty(): buffers from `Client.empty()`, reduced where they lie (no copy).")
    add("- gradsync numpy: ordinary `np.empty` arrays, staged through a scratch segment "
        "(copy in, copy back) on every op.")
    add("- torch gloo: `torch.distributed` gloo, file:// store, `all_reduce` on "
        "`torch.from_numpy` views.")
    add("- Open MPI: mpi4py `Allreduce(MPI.IN_PLACE, ...)`, Open MPI defaults (vader "
        "shared-memory transport, default binding).")
    if run.daemon_command:
        add(f"\nPrivate daemon: `{run.daemon_command}`.")
    if run.mpirun_command:
        add(f"MPI launch: `{run.mpirun_command}`.")
    add("")
    for nproc in nprocs:
        cores = os.cpu_count() or 1
        note = f" ({cores} cores: oversubscribed)" if nproc > cores else ""
        add(f"## N = {nproc}{note}\n")
        add(results_table(runs, sizes, nproc))
        add("")
    add("## Small-message latency\n")
    add(latency_table(runs, nprocs))
    add("")
    add("## Targets\n")
    add("\n".join(target_lines(runs, sizes)) or "- not measured in this run")
    add("")
    issues = problems(runs, all_runs) + [f"- {line}" for line in run.daemon_notes]
    if issues:
        add("## Problems in this run\n")
        add("\n".join(issues))
        add("")
    add("## Diagnostics\n")
    add(
        "CPU cores busy = CPU seconds used by all ranks (and, for gradsync, the daemon) "
        "during the timed samples, per wall second; the machine has "
        f"{os.cpu_count()}. MPI ranks poll while they wait, so they show busy even when idle.\n"
    )
    for nproc in nprocs:
        add(f"### N = {nproc}\n")
        add(details_table(runs, sizes, nproc))
        add("")
    add("### Background load\n")
    add(
        "This machine may be shared. Before each contender the benchmark waits (up to "
        "--quiet-wait-s) for other processes to drop below 0.25 cores; the load they "
        "caused while it ran is machine-wide busy CPU minus this benchmark's own. With "
        "--repeat, the tables show per contender and N the repeat with the least "
        "background load. "
        f"Load average at the start: {run.load_average}.\n"
    )
    add(load_table(all_runs, runs))
    add("")
    add("### Raw paths on this machine\n")
    if run.probe_background is not None:
        add(
            "Measured before the contenders (best of a few repeats for bandwidth); other "
            f"processes used {run.probe_background:.2f} cores meanwhile.\n"
        )
    add("| path | result |")
    add("|---|---:|")
    for label, gbps in run.probes.items():
        add(f"| {label} | {gbps:.1f} GB/s |")
    labels = {
        "ping": "gradsync `ping` round trip on a client's socket",
        "allreduce-solo": "gradsync 4 KiB allreduce, job of 1 rank (no waiting, no reduction)",
    }
    for key, (p50, p99) in run.round_trips.items():
        base, _, placement = key.partition(", ")
        label = labels.get(base, base)
        if placement:
            label += f"; client and daemon on {placement}"
        add(f"| {label} | {p50:.0f} µs p50, {p99:.0f} µs p99 |")
    add("")
    add("## What limits it\n")
    add(NOTES_BEGIN)
    add(notes if notes else _NOTES_PLACEHOLDER)
    add(NOTES_END)
    add("")
    return "\n".join(out)


def size_list(sizes: Sequence[int]) -> str:
    return ", ".join(format_size(s) for s in sizes)
