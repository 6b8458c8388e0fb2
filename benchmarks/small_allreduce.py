"""Small allreduces side by side: gradsync's client and torch backend, gloo, Open MPI.

    python -m benchmarks.small_allreduce [--nproc 2,4] [--sizes 4K,64K,1M] [--rounds 4]

One node, float32 sum, in place.  Every contender runs the same rank program
(benchmarks/latency_rank.py: batches of back-to-back ops, a barrier before each
batch, rank 0's microseconds per op): `Client.all_reduce` on `Client.empty`
buffers and `dist.all_reduce` on backend "gradsync" under `gradsync launch`
(a private daemon, shipped defaults), `dist.all_reduce` on gloo under torchrun,
mpi4py's `Allreduce(IN_PLACE)` under mpirun.  The contenders take turns, round
after round (the order reversed every other round), so all see the same machine.
A missing contender (no mpirun, no mpi4py) is left out with a note.  Prints one
markdown table per N: the median over all samples, the lowest and highest round
median, and the ratios the targets are stated in (client/MPI, torch/client).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import machine
from benchmarks.latency_ab import parse_size, size_name

RANK_PROGRAM = Path(__file__).resolve().parent / "latency_rank.py"
CONTENDERS = ("client", "torch", "gloo", "mpi")
TITLES = {"client": "gradsync Client", "torch": "gradsync dist", "gloo": "gloo dist",
          "mpi": "Open MPI"}


def command(contender: str, nproc: int, rank_args: list[str]) -> list[str]:
    program = [str(RANK_PROGRAM), "--api", contender, *rank_args]
    if contender in ("client", "torch"):
        return [sys.executable, "-m", "gradsync.client.cli", "launch",
                "--nproc-per-node", str(nproc), *program]
    if contender == "gloo":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), *program]
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nproc),
            sys.executable, *program]


def available(contender: str) -> str | None:
    """Why `contender` cannot run here, or None."""
    if contender == "mpi" and shutil.which("mpirun") is None:
        return "no mpirun (apt-get install openmpi-bin libopenmpi-dev)"
    if contender == "mpi" and importlib.util.find_spec("mpi4py") is None:
        return "no mpi4py (pip install mpi4py)"
    if contender in ("torch", "gloo") and importlib.util.find_spec("torch") is None:
        return "no torch"
    return None


def run(contender: str, nproc: int, rank_args: list[str]) -> dict[int, list[float]]:
    done = subprocess.run(command(contender, nproc, rank_args), capture_output=True,
                          text=True, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("LATENCY "):
            return {int(size): values for size, values in json.loads(line[8:]).items()}
    raise RuntimeError(f"{contender} N={nproc} printed no result (exit {done.returncode}):\n"
                       f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


def table(nproc: int, sizes: list[int], cells: dict[str, dict[int, list[list[float]]]]) -> str:
    """Per size: each contender's median µs [round medians] and the target ratios."""
    names = list(cells)
    head = " | ".join(f"{TITLES[name]} µs [rounds]" for name in names)
    lines = [f"### N = {nproc}", "", f"| size | {head} | client/MPI | dist/client |",
             "|---|" + "---:|" * (len(names) + 2)]
    for size in sizes:
        medians = {}
        parts = []
        for name in names:
            rounds = cells[name][size]
            medians[name] = statistics.median([v for values in rounds for v in values])
            per_round = [statistics.median(values) for values in rounds]
            parts.append(f"{medians[name]:.1f} [{min(per_round):.1f}–{max(per_round):.1f}]")
        ratios = [f"{medians[a] / medians[b]:.2f}" if a in medians and b in medians else "–"
                  for a, b in (("client", "mpi"), ("torch", "client"))]
        lines.append(f"| {size_name(size)} | " + " | ".join(parts + ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", default="2,4")
    parser.add_argument("--sizes", default="4K,64K,1M")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--batch", type=int, default=100, help="ops per sample up to 64 KiB")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    args = parser.parse_args(argv)
    sizes = [parse_size(text) for text in args.sizes.split(",")]
    rank_args = ["--sizes", ",".join(map(str, sizes)), "--samples", str(args.samples),
                 "--batch", str(args.batch)]
    contenders = []
    for name in args.contenders.split(","):
        why = available(name)
        if why is None:
            contenders.append(name)
        else:
            print(f"note: {TITLES[name]} left out: {why}")
    print(f"CPU: {machine.cpu_model()}; {args.rounds} rounds, float32 sum, in place, "
          f"{args.samples} samples a size and round")
    for nproc in (int(text) for text in args.nproc.split(",")):
        cells: dict[str, dict[int, list[list[float]]]] = {
            name: {size: [] for size in sizes} for name in contenders}
        for round_index in range(args.rounds):
            order = contenders if round_index % 2 == 0 else contenders[::-1]
            for name in order:
                for size, values in run(name, nproc, rank_args).items():
                    cells[name][size].append(values)
        print()
        print(table(nproc, sizes, cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
