"""Where `Client()` finds its identity: explicit arguments, torchrun, Slurm, Open MPI.

Unit tests of `resolve_identity(environ=...)` for each launcher style and their
precedence, and end-to-end runs of rank processes that see only Slurm-style or
only Open MPI-style variables against a real daemon.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import PROGRAMS, DaemonProcess, collect
from gradsync.client.environment import parse_slurm_tasks_per_node, resolve_identity
from gradsync.protocol.errors import InvalidArgumentError

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
SLURM = {
    "SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "2(x3)", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
}
#: Launcher variables of this test process that would leak into the rank processes.
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GRADSYNC_JOB")


def who(environ: dict[str, str], **explicit: int) -> tuple[str, int, int, int, int]:
    identity = resolve_identity(environ=environ, **explicit)  # type: ignore[arg-type]
    return (identity.source, identity.rank, identity.world_size, identity.local_rank,
            identity.local_world_size)


# -- unit tests ------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("value", "counts"),
    [("4", [4]), ("2(x3)", [2, 2, 2]), ("3,2(x2)", [3, 2, 2]), ("1,4(x2),2", [1, 4, 4, 2]),
     (" 2 (x 2) ", [2, 2])],
)
def test_slurm_tasks_per_node_expand(value: str, counts: list[int]) -> None:
    assert parse_slurm_tasks_per_node(value) == counts


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value", ["", "x", "2(3)", "2(x)", "-1", "2,,3"])
def test_slurm_tasks_per_node_refuses_garbage(value: str) -> None:
    with pytest.raises(InvalidArgumentError, match="tasks per node"):
        parse_slurm_tasks_per_node(value)


@pytest.mark.timeout(10)
def test_each_launcher_style_alone() -> None:
    assert who({}) == ("single", 0, 1, 0, 1)
    assert who(TORCHRUN) == ("torchrun", 5, 8, 1, 4)
    assert who(SLURM) == ("slurm", 3, 6, 1, 2)
    assert who(OMPI) == ("openmpi", 2, 3, 0, 1)


@pytest.mark.timeout(10)
def test_precedence_explicit_then_torchrun_then_slurm_then_openmpi() -> None:
    everything = {**TORCHRUN, **SLURM, **OMPI}
    assert who(everything) == ("torchrun", 5, 8, 1, 4)
    assert who({**SLURM, **OMPI}) == ("slurm", 3, 6, 1, 2)
    assert who(everything, rank=0, world_size=2, local_rank=0, local_world_size=2) == (
        "explicit", 0, 2, 0, 2)
    # Explicit fields win one by one; the rest come from the first launcher style only.
    assert who({**SLURM, **OMPI}, rank=4) == ("slurm", 4, 6, 1, 2)
    assert who({**SLURM, **OMPI}, rank=0, world_size=2, local_rank=0) == (
        "explicit", 0, 2, 0, 2)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("per_node", "node", "local_world_size"),
    [("4", None, 4), ("4", "2", 4), ("2(x3)", "2", 2), ("3,2(x2)", "0", 3),
     ("3,2(x2)", "2", 2), ("1,5", "1", 5)],
)
def test_slurm_picks_this_nodes_task_count(
    per_node: str, node: str | None, local_world_size: int
) -> None:
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0",
               "SLURM_NTASKS_PER_NODE": per_node, "SLURM_STEP_ID": "0"}
    if node is not None:
        environ["SLURM_NODEID"] = node
    assert resolve_identity(environ=environ).local_world_size == local_world_size


@pytest.mark.timeout(10)
def test_slurm_falls_back_to_the_step_layout_and_single_node() -> None:
    base = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEPID": "2"}
    step = {**base, "SLURM_STEP_TASKS_PER_NODE": "1,3", "SLURM_NODEID": "1"}
    assert resolve_identity(environ=step).local_world_size == 3
    one_node = {**base, "SLURM_NNODES": "1"}
    assert resolve_identity(environ=one_node).local_world_size == 4
    older = {"SLURM_PROCID": "0", "SLURM_NPROCS": "1", "SLURM_STEPID": "0"}
    assert resolve_identity(environ=older).world_size == 1


@pytest.mark.timeout(10)
def test_default_job_names_are_the_same_on_every_node() -> None:
    slurm = {**SLURM, "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}
    assert resolve_identity(environ=slurm).job == "slurm-4242.3"
    assert resolve_identity(environ={**slurm, "GRADSYNC_JOB": "mine"}).job == "mine"
    assert resolve_identity(environ={**OMPI, "PMIX_NAMESPACE": "prterun-h-1@1"}).job == (
        "ompi-prterun-h-1@1")
    assert resolve_identity(environ=OMPI).job == "default"
    assert resolve_identity(environ=TORCHRUN).job == "default"
    assert resolve_identity(environ=slurm, job="explicit").job == "explicit"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}, "SLURM_PROCID and SLURM_NTASKS"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE"),
        ({"RANK": "0"}, "RANK and WORLD_SIZE"),
        ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
        ({**SLURM, "SLURM_PROCID": "6"}, "rank 6 is outside world_size 6 (from slurm"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "1"},
         "SLURM_NTASKS_PER_NODE"),
        ({**SLURM, "SLURM_NTASKS_PER_NODE": "3,3", "SLURM_NODEID": ""}, "SLURM_NODEID"),
        ({**SLURM, "SLURM_NTASKS_PER_NODE": "3,3", "SLURM_NODEID": "2"}, "outside the 2 nodes"),
        ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "local_rank < local_world_size"),
    ],
)
def test_bad_launcher_variables_are_refused_naming_them(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        resolve_identity(environ=environ)
    assert message in str(caught.value)


#: What a process of an sbatch script sees (no srun): Slurm's task variables, no step.
BATCH_SCRIPT = {
    "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NUM_NODES": "2",
}


@pytest.mark.timeout(10)
def test_a_batch_script_without_srun_runs_as_a_job_of_one_and_says_so() -> None:
    identity = resolve_identity(environ=BATCH_SCRIPT)
    assert (identity.source, identity.rank, identity.world_size, identity.local_world_size) == (
        "single", 0, 1, 1)
    assert identity.job == "default"
    assert identity.note is not None
    for needle in ("SLURM_NTASKS=4", "SLURM_STEP_ID", "job of one", "srun"):
        assert needle in identity.note
    # The same variables in a task of an srun step (either spelling of the step): 4 ranks.
    for step in ("SLURM_STEP_ID", "SLURM_STEPID"):
        task = resolve_identity(environ={**BATCH_SCRIPT, step: "0", "SLURM_PROCID": "3",
                                         "SLURM_NODEID": "1", "SLURM_LOCALID": "1"})
        assert (task.source, task.rank, task.world_size, task.local_world_size, task.note) == (
            "slurm", 3, 4, 2, None)
    # Nothing to say where the allocation is one task, or another launcher started it.
    assert resolve_identity(environ={**BATCH_SCRIPT, "SLURM_NTASKS": "1"}).note is None
    assert resolve_identity(environ={k: v for k, v in BATCH_SCRIPT.items()
                                     if k != "SLURM_NTASKS"}).note is None
    under_torchrun = resolve_identity(environ={**BATCH_SCRIPT, **TORCHRUN})
    assert (under_torchrun.source, under_torchrun.note) == ("torchrun", None)
    under_mpirun = resolve_identity(environ={**BATCH_SCRIPT, **OMPI})
    assert (under_mpirun.source, under_mpirun.rank, under_mpirun.note) == ("openmpi", 2, None)


@pytest.mark.timeout(60)
def test_client_in_a_batch_script_warns_and_works_alone(daemon: DaemonProcess) -> None:
    environ = {**launcher_free_environ(), **BATCH_SCRIPT, "GRADSYNC_DAEMON": daemon.endpoint}
    [result] = collect([subprocess.Popen(
        [sys.executable, str(PROGRAMS / "env_report.py")], env=environ,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )], timeout_s=50)
    assert result.returncode == 0, result.stderr
    [record] = result.records()
    assert (record["source"], record["rank"], record["world_size"], record["sum"]) == (
        "single", 0, 1, 0)
    assert "RuntimeWarning: gradsync: SLURM_NTASKS=4 is set but SLURM_STEP_ID is not" in (
        result.stderr)


# -- end to end ------------------------------------------------------------------


def launcher_free_environ() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items()
        if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES
    }


def spawn(endpoint: str, variables: list[dict[str, str]]) -> list[subprocess.Popen[str]]:
    base = {**launcher_free_environ(), "GRADSYNC_DAEMON": endpoint}
    return [
        subprocess.Popen(
            [sys.executable, str(PROGRAMS / "env_report.py")], env={**base, **rank_vars},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank_vars in variables
    ]


def slurm_task(rank: int) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "0"}


def ompi_task(rank: int) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "PMIX_NAMESPACE": "prterun-test-1@1"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("style", "task", "job"),
    [("slurm", slurm_task, "slurm-77.0"), ("openmpi", ompi_task, "ompi-prterun-test-1@1")],
)
def test_ranks_from_launcher_variables_alone_reduce_together(
    daemon: DaemonProcess, style: str, task: object, job: str
) -> None:
    # Started in reverse order: the ranks come from the variables, not the start order.
    processes = spawn(daemon.endpoint, [task(rank) for rank in (1, 0)])  # type: ignore[operator]
    results = collect(processes, timeout_s=50)
    records = []
    for result in results:
        assert result.returncode == 0, result.stderr
        records.extend(result.records())
    assert sorted(r["rank"] for r in records) == [0, 1]
    for record in records:
        assert record["source"] == style
        assert (record["world_size"], record["local_world_size"]) == (2, 2)
        assert record["local_rank"] == record["rank"]
        assert record["job"] == job
        assert record["sum"] == 0 + 1 and record["bits"] == 0b11


def test_gradsync_compression_applies_only_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job-wide default compresses float sums and leaves integer allreduces,
    barriers (int8 max) and device buffers exact; a call's own choice is strict."""
    from gradsync.client.compression import Compression, choose, from_environment
    from gradsync.protocol.errors import InvalidArgumentError

    monkeypatch.setenv("GRADSYNC_COMPRESSION", "fp8")
    monkeypatch.setenv("GRADSYNC_ERROR_FEEDBACK", "1")
    default = from_environment()
    assert default == Compression("fp8", True)
    assert choose(None, False, default, "allreduce", "float32", "avg") == default
    assert choose(None, False, default, "allreduce", "int8", "max") == Compression()
    assert choose(None, False, default, "broadcast", "float32", None) == Compression()
    assert choose(None, False, default, "allreduce", "float32", "sum", True) == Compression()
    assert choose("none", False, default, "allreduce", "float32", "sum") == Compression()
    with pytest.raises(InvalidArgumentError, match="int8"):
        choose("bf16", False, default, "allreduce", "int8", "sum")
    with pytest.raises(InvalidArgumentError, match="device buffers"):
        choose("bf16", False, default, "allreduce", "float32", "sum", True)
    monkeypatch.setenv("GRADSYNC_COMPRESSION", "fp4")
    with pytest.raises(InvalidArgumentError, match="GRADSYNC_COMPRESSION='fp4'"):
        from_environment()


def test_a_private_daemon_socket_leaves_a_runtime_folder_too_deep_for_its_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's workers, for one, may run under an XDG_RUNTIME_DIR too deep for a Unix socket."""
    pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")
    from gradsync.client.torch.private_daemon import _private_endpoint
    from gradsync.protocol.endpoint import MAX_SOCKET_PATH, parse_ipc_endpoint

    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/0")
    near = _private_endpoint("job", "node")
    assert near.startswith("ipc:///run/user/0/gradsync-job-"), near
    assert _private_endpoint("job", "node") == near  # every rank of the node agrees
    assert _private_endpoint("job", "other node") != near
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/tmp/" + "deep/" * 14)
    far = _private_endpoint("job", "node")
    assert far.startswith("ipc:///tmp/gradsync-job-"), far
    assert len(parse_ipc_endpoint(far + ".stats.pub")) <= MAX_SOCKET_PATH
