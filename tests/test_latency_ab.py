"""The small-collective latency guard (benchmarks/latency_ab.py): its verdict, and one
real alternating run of two trees.  It measures; these tests check only that it
runs, reads its own results right and judges by the rule it states."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.latency_ab import Cell, parse_size, size_name, slower

ROOT = Path(__file__).resolve().parent.parent


def cell(*round_medians: float) -> Cell:
    """A cell whose samples are its round medians (one sample a round)."""
    return Cell(samples=list(round_medians), round_medians=list(round_medians))


@pytest.mark.timeout(10)
def test_slower_means_beyond_the_tolerance_and_beyond_the_spread() -> None:
    reference = cell(10.0, 10.2, 9.9, 10.1)
    assert slower(cell(12.0, 12.5, 11.9, 12.2), reference, 0.10)
    # 5 % slower: within the tolerance.
    assert not slower(cell(10.5, 10.6, 10.4, 10.5), reference, 0.10)
    # Its median is 20 % up, but one round was as fast as the reference: noise.
    assert not slower(cell(12.0, 12.2, 9.8, 12.1), reference, 0.10)
    assert not slower(reference, cell(12.0, 12.5, 11.9, 12.2), 0.10)


@pytest.mark.timeout(10)
def test_sizes_read_and_written_alike() -> None:
    assert [parse_size(text) for text in ("4K", "64k", "1M", "100")] == [4096, 65536,
                                                                          1 << 20, 100]
    assert [size_name(n) for n in (4096, 65536, 1 << 20, 100)] == ["4K", "64K", "1M", "100"]


@pytest.mark.alone
@pytest.mark.timeout(180)
def test_the_guard_runs_two_trees_in_turn_and_gives_a_verdict() -> None:
    """The working tree against HEAD, one short round: a table with both trees, a
    time per op at each size, and a verdict naming the commit."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.latency_ab", "--against", "HEAD", "--rounds", "1",
         "--samples", "3", "--batch", "20", "--sizes", "4K,64K"],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    rows = {line.split()[1]: line for line in done.stdout.splitlines()
            if line.startswith(f"| {head} ") or line.startswith("| WORKTREE ")}
    assert set(rows) == {head, "WORKTREE"}, done.stdout
    for row in rows.values():
        medians = [float(value) for value in re.findall(r"\| ([0-9.]+) \[", row)]
        assert len(medians) == 2 and all(value > 0 for value in medians), row
    verdict = done.stdout.strip().splitlines()[-1]
    expected = "SLOWER than" if done.returncode else "not slower than"
    assert verdict.startswith(f"{expected} {head}"), done.stdout
