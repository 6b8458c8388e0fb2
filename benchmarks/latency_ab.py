"""Small-collective latency of several trees in one alternating run: A/B, guard, bisect.

Every tree (a commit, or the working tree) is unpacked once under
benchmarks/out/trees/, its C modules built in place, and run from its own
`.mypy-src` on PYTHONPATH with this interpreter's packages, so the trees differ
only in gradsync.  One round runs every tree once, in turn (A B A B ...), each a
fresh `gradsync launch` of benchmarks/latency_rank.py (one daemon, `--ranks`
ranks, `Client.all_reduce` on `Client.empty` buffers or `dist.all_reduce` with
`--api torch`) that times `--samples` batches of `--batch` back-to-back ops per
size.  Per tree and size the report gives the median microseconds per op over all
samples, the lowest and highest round median (the run's spread) and the ratio to
the first tree.

    python -m benchmarks.latency_ab --against 82060e4              # the guard (README)
    python -m benchmarks.latency_ab --trees 82060e4,HEAD,WORKTREE  # any trees, in turn
    python -m benchmarks.latency_ab --bisect 82060e4..HEAD         # where it got slower

`--against C` compares the working tree with commit C and exits 1 when the working
tree is slower at some size beyond `--tolerance` and beyond the run's spread (even
its fastest round above the reference's median: `slower()`), so a change that costs
small-collective time shows before it lands.  `--bisect A..B` walks B's first-parent history from A:
it measures the ends and the middle of an interval in one run and goes on into
every half whose ends differ beyond the tolerance and the spread, so several
commits that each cost a little are all found; it prints every commit measured and
the steps found.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.ab_allreduce import parse_size

ROOT = Path(__file__).resolve().parent.parent
TREES = ROOT / "benchmarks" / "out" / "trees"
RANK_PROGRAM = Path(__file__).resolve().parent / "latency_rank.py"
WORKTREE = "WORKTREE"
def size_name(nbytes: int) -> str:
    for suffix, unit in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@dataclasses.dataclass
class Tree:
    """One tree under test: its label, where its sources lie, and its subject line."""

    label: str
    path: Path
    subject: str


def prepare(name: str) -> Tree:
    """Unpack commit `name` (or take the working tree) and build its C modules in place."""
    if name == WORKTREE:
        path, label, subject = ROOT, WORKTREE, "the working tree"
    elif os.path.isdir(name):  # an unpacked tree elsewhere (an experiment)
        path, label, subject = Path(name).resolve(), name, f"the tree in {name}"
    else:
        sha = git("rev-parse", "--verify", f"{name}^{{commit}}")
        label, subject = sha[:7], git("log", "-1", "--format=%s", sha)
        path = TREES / sha
        if not (path / ".built").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    if not (path / ".built").exists() or label == name:
        built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                               cwd=path, capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"{label}: building its C modules failed:\n{built.stderr}")
        if label != name:
            (path / ".built").touch()
    return Tree(label, path, subject)


def run_once(tree: Tree, args: argparse.Namespace) -> dict[int, list[float]]:
    """One `gradsync launch` of the rank program on `tree`: per size, µs per op per sample."""
    env = {**os.environ, "PYTHONPATH": str(tree.path / ".mypy-src")}
    env.pop("GRADSYNC_DAEMON", None)  # a private daemon of this tree, never a running one
    command = [sys.executable, "-m", "gradsync.client.cli", "launch",
               "--nproc-per-node", str(args.ranks), str(RANK_PROGRAM), "--api", args.api,
               "--sizes", ",".join(str(size) for size in args.sizes),
               "--batch", str(args.batch), "--samples", str(args.samples)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                          cwd="/")
    for line in done.stdout.splitlines():
        if line.startswith("LATENCY "):
            return {int(size): values for size, values in json.loads(line[8:]).items()}
    raise RuntimeError(f"{tree.label}: the run printed no result (exit {done.returncode}):\n"
                       f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


@dataclasses.dataclass
class Cell:
    """One tree at one size over the whole run."""

    samples: list[float] = dataclasses.field(default_factory=list)
    round_medians: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def measure(trees: list[Tree], args: argparse.Namespace) -> dict[str, dict[int, Cell]]:
    """`args.rounds` rounds, every tree once per round in turn: per tree, per size."""
    cells = {tree.label: {size: Cell() for size in args.sizes} for tree in trees}
    for round_index in range(args.rounds):
        order = trees if round_index % 2 == 0 else trees[::-1]  # A B, then B A
        for tree in order:
            for size, values in run_once(tree, args).items():
                cell = cells[tree.label][size]
                cell.samples += values
                cell.round_medians.append(statistics.median(values))
        if args.verbose:
            print(f"round {round_index + 1}/{args.rounds}: " + "; ".join(
                f"{label} " + " ".join(f"{cell.round_medians[-1]:.1f}" for cell in row.values())
                for label, row in cells.items()), file=sys.stderr, flush=True)
    return cells


def slower(candidate: Cell, reference: Cell, tolerance: float) -> bool:
    """Whether `candidate` is slower than `reference` beyond `tolerance` and beyond the
    run's spread: its median over the tolerance, and even its fastest round median
    above the reference's median."""
    return (candidate.median > reference.median * (1 + tolerance)
            and min(candidate.round_medians) > reference.median)


def report(trees: list[Tree], cells: dict[str, dict[int, Cell]], args: argparse.Namespace) -> str:
    """A markdown table: per tree and size, median µs/op [spread] and the ratio."""
    first = cells[trees[0].label]
    head = " | ".join(f"{size_name(size)} µs [round medians] | ×" for size in args.sizes)
    lines = [f"| tree | {head} |", "|---|" + "---:|---:|" * len(args.sizes)]
    for tree in trees:
        row = cells[tree.label]
        parts = []
        for size in args.sizes:
            cell = row[size]
            parts.append(f"{cell.median:.1f} [{min(cell.round_medians):.1f}–"
                         f"{max(cell.round_medians):.1f}] | {cell.median / first[size].median:.2f}")
        lines.append(f"| {tree.label} {tree.subject[:50]} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def first_parent(span: str) -> list[str]:
    """The commits of `A..B` on B's first-parent line, oldest first, A included."""
    start, end = span.split("..")
    shas = git("rev-list", "--first-parent", "--reverse", f"{start}..{end or 'HEAD'}").split()
    return [git("rev-parse", start), *shas]


def bisect(span: str, args: argparse.Namespace) -> int:
    """Find every first-parent step in `span` that costs time beyond tolerance and spread."""
    commits = first_parent(span)
    measured: dict[str, float] = {}
    steps: list[tuple[str, str, float]] = []
    pending = [(0, len(commits) - 1)]
    while pending:
        lo, hi = pending.pop(0)
        mid = (lo + hi) // 2
        names = [commits[lo], commits[hi]] + ([commits[mid]] if lo < mid < hi else [])
        trees = [prepare(name) for name in names]
        cells = measure(trees, args)
        print(report(trees, cells, args), flush=True)
        size = args.sizes[0]
        by_index = {lo: cells[trees[0].label][size], hi: cells[trees[1].label][size]}
        if len(trees) == 3:
            by_index[mid] = cells[trees[2].label][size]
        for index, cell in by_index.items():
            measured.setdefault(commits[index][:7], cell.median)
        if not slower(by_index[hi], by_index[lo], args.tolerance):
            continue
        if hi - lo == 1:
            parents = git("rev-list", "--parents", "-n", "1", commits[hi]).split()[1:]
            if len(parents) > 1:  # a merge: the cost came in on its branch; walk that
                base = git("merge-base", parents[0], parents[1])
                print(f"{commits[hi][:7]} is a merge: into {base[:7]}..{parents[1][:7]}")
                start = len(commits)
                commits += first_parent(f"{base}..{parents[1]}")
                pending.append((start, len(commits) - 1))
                continue
            steps.append((commits[lo][:7], commits[hi][:7],
                          by_index[hi].median / by_index[lo].median))
            continue
        for a, b in ((lo, mid), (mid, hi)):
            if slower(by_index[b], by_index[a], args.tolerance):
                pending.append((a, b))
    print(f"\nmedian µs per op at {size_name(args.sizes[0])} (first measurement of each):")
    for sha, value in measured.items():
        print(f"  {sha} {value:.1f}")
    print("steps that cost time:" if steps else "no step beyond tolerance and spread")
    for before, after, ratio in steps:
        print(f"  {before} -> {after}: x{ratio:.2f}  {git('log', '-1', '--format=%s', after)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--against", metavar="COMMIT",
                      help="the working tree against COMMIT; exit 1 if slower")
    what.add_argument("--trees", help=f"comma-separated commits, directories holding an "
                      f"unpacked tree, or {WORKTREE}; run in turn")
    what.add_argument("--bisect", metavar="A..B", help="find the commits that cost time")
    parser.add_argument("--api", choices=("client", "torch"), default="client")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", default="4K,64K",
                        help="comma-separated, e.g. 4K,64K (bisect follows the first)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--samples", type=int, default=40, help="samples per size per run")
    parser.add_argument("--batch", type=int, default=100, help="ops per sample")
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="a slowdown smaller than this fraction is noise")
    parser.add_argument("-v", "--verbose", action="store_true", help="each round's medians")
    args = parser.parse_args(argv)
    args.sizes = [parse_size(text) for text in args.sizes.split(",")]
    if args.bisect:
        return bisect(args.bisect, args)
    names = [args.against, WORKTREE] if args.against else args.trees.split(",")
    trees = [prepare(name) for name in names]
    cells = measure(trees, args)
    print(f"{args.api} all_reduce, {args.ranks} ranks on one daemon, float32 sum; "
          f"{args.rounds} rounds of {args.samples}×{args.batch} ops per tree and size")
    print(report(trees, cells, args))
    if not args.against:
        return 0
    worse = [size for size in args.sizes
             if slower(cells[WORKTREE][size], cells[trees[0].label][size], args.tolerance)]
    if worse:
        print(f"SLOWER than {trees[0].label} at {', '.join(map(size_name, worse))} "
              f"(beyond {args.tolerance:.0%} and the run's spread)")
        return 1
    print(f"not slower than {trees[0].label} beyond {args.tolerance:.0%} and the run's spread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
