"""`gradsync bench`: the nccl-tests table over real daemons: one node (a private
daemon, with gloo beside it), and a job across two daemons, where the
algorithm column is what the daemons' `auto` picked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cluster import free_ports

pytestmark = pytest.mark.timeout(180)
BENCH = [sys.executable, "-m", "gradsync.client.cli", "bench", "--seconds", "0.02", "--json"]
FACTORS = {"allreduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n}


def rows_of(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def check_rows(rows: list[dict[str, object]], libraries: set[str], ranks: int) -> None:
    ops = set(FACTORS)
    assert {(r["library"], r["op"], r["size"]) for r in rows} == {
        (library, op, size) for library in libraries for op in ops for size in (4096, 65536)
    }, rows
    for row in rows:
        seconds = float(row["time_us"]) / 1e6  # type: ignore[arg-type]
        assert seconds > 0 and row["ranks"] == ranks
        algbw = int(row["size"]) / seconds / 1e9  # type: ignore[call-overload]
        assert row["algbw_gbps"] == pytest.approx(algbw)
        assert row["busbw_gbps"] == pytest.approx(algbw * FACTORS[str(row["op"])](ranks))


def test_one_node_with_gloo() -> None:
    pytest.importorskip("torch")
    result = subprocess.run([*BENCH, "--nproc-per-node", "2", "--sizes", "4KiB,64KiB",
                             "--vs", "gloo"], capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = rows_of(result.stdout)
    check_rows(rows, {"gradsync", "gloo"}, 2)
    assert {r["algorithm"] for r in rows if r["library"] == "gradsync"} == {"local"}


def test_across_two_daemons() -> None:
    ports = free_ports(3)
    peers = ",".join(f"tcp://127.0.0.1:{port}" for port in ports[:2])
    nodes = [
        subprocess.Popen(
            [*BENCH, "--nproc-per-node", "1", "--sizes", "4096,65536", "--ops",
             "allreduce,all_gather,reduce_scatter", "--", "--nnodes", "2", "--node-rank",
             str(node), "--listen", f"tcp://127.0.0.1:{ports[node]}", "--peers", peers,
             "--insecure", "--master-port", str(ports[2]), "--job", "bench"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        for node in range(2)
    ]
    outputs = [node.communicate(timeout=150) for node in nodes]
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out + err
    rows = rows_of(outputs[0][0])
    check_rows(rows, {"gradsync"}, 2)
    assert rows_of(outputs[1][0]) == []  # rank 0 alone prints
    picked = {r["algorithm"] for r in rows if r["op"] == "allreduce"}
    assert picked <= {"ring", "tree", "rhd", "star"}, rows


def test_bad_ops_named() -> None:
    result = subprocess.run([*BENCH, "--ops", "allreduce,broadcastt"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "broadcastt" in result.stderr, result.stderr
