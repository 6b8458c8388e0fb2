"""Slurm: `gradsyncd --peers-from-slurm`, and examples/slurm/train.sbatch on a real Slurm.

First, fast unit tests of the node list handling through a stand-in `scontrol`
on PATH.  Then, marked `slurm` (run them alone with `pytest -m slurm`), a real
Slurm started by the test itself (tests/slurm_cluster.py): one node on
127.0.0.1, where the batch script trains on two ranks and a plain `python` in a
batch script runs as a job of one; and two nodes, each slurmd in its own
network and UTS namespace, where the script's daemons form one job over their
peer links.  These skip, saying why, without Slurm and MUNGE or without root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cluster import free_ports
from slurm_cluster import JobResult, SlurmCluster, skip_reason

from conftest import PROGRAMS, DaemonProcess
from gradsync.client.cli.stats import fetch_snapshot
from gradsync.daemon.config import ConfigError, load_config
from gradsync.daemon.main import main as gradsyncd_main
from gradsync.daemon.slurm import expand_hostnames, with_slurm_peers

StartDaemon = Callable[..., DaemonProcess]
REPO = Path(__file__).resolve().parents[1]
TRAIN_SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
NODELIST = "node[01-03,07],gpu-a"
EXPANDED = ["node01", "node02", "node03", "node07", "gpu-a"]
TRAIN_LINE = re.compile(
    r"^gradsync-train: rank=(\d+) world=(\d+) node=(\S+) identical=(\w+) max_error=(\S+)$",
    re.MULTILINE,
)

# -- --peers-from-slurm through a stand-in scontrol --------------------------------

STAND_IN = """#!{python}
# A stand-in for Slurm's scontrol: `show hostnames LIST` for the lists the test knows.
import sys
answers = {answers!r}
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"] and sys.argv[3] in answers:
    print("\\n".join(answers[sys.argv[3]]))
    sys.exit(0)
print("scontrol: error: Unable to create hostlist from " + sys.argv[-1], file=sys.stderr)
sys.exit(1)
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """An environment whose PATH finds only the stand-in scontrol; and its call log."""
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "scontrol.log"
    script = folder / "scontrol"
    script.write_text(STAND_IN.format(
        python=sys.executable, log=str(log),
        answers={NODELIST: EXPANDED, "localhost": ["localhost"]},
    ))
    script.chmod(0o755)
    yield {"PATH": str(folder), "SLURM_JOB_NODELIST": NODELIST, "SLURMD_NODENAME": "node03"}, log


def from_slurm(environ: dict[str, str], **flags: object) -> tuple[str | None, tuple[str, ...]]:
    config = load_config(flags={"peers_from_slurm": True, **flags}, environ={})
    resolved = with_slurm_peers(config, environ)
    return resolved.listen, resolved.peers


@pytest.mark.timeout(30)
def test_peers_are_every_node_of_the_allocation_at_the_port(
    stand_in: tuple[dict[str, str], Path],
) -> None:
    environ, log = stand_in
    listen, peers = from_slurm(environ, port="7070")
    assert peers == tuple(f"tcp://{node}:7070" for node in EXPANDED)
    assert listen == "tcp://node03:7070"  # this node's name, as its peers dial it
    assert log.read_text().splitlines() == [f"show hostnames {NODELIST}"]
    # The default port; an explicit --listen is kept; --peers come first, not twice.
    assert from_slurm(environ)[0] == "tcp://node03:29400"
    listen, peers = from_slurm(environ, listen="tcp://0.0.0.0:7070", port=7070,
                               peers="tcp://extra:1,tcp://node01:7070")
    assert listen == "tcp://0.0.0.0:7070"
    assert peers[:2] == ("tcp://extra:1", "tcp://node01:7070") and len(peers) == 6
    # The older variable name; and without the flag, nothing is asked.
    older = {**environ, "SLURM_NODELIST": NODELIST}
    del older["SLURM_JOB_NODELIST"]
    assert from_slurm(older)[1][0] == "tcp://node01:29400"
    plain = load_config(flags={}, environ={})
    assert with_slurm_peers(plain, {}) is plain


@pytest.mark.timeout(30)
def test_peers_from_slurm_errors_say_what_is_missing(
    stand_in: tuple[dict[str, str], Path], tmp_path: Path,
) -> None:
    environ, _log = stand_in
    cases = [
        ({**environ, "PATH": str(tmp_path)}, "scontrol is not on PATH"),
        ({k: v for k, v in environ.items() if k != "SLURM_JOB_NODELIST"},
         "SLURM_JOB_NODELIST is not set"),
        ({**environ, "SLURM_JOB_NODELIST": "node[01-"},
         "Unable to create hostlist from node[01-"),
        ({k: v for k, v in environ.items() if k != "SLURMD_NODENAME"},
         "cannot tell which node of node01, node02"),
    ]
    for case, needle in cases:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            from_slurm(case)
    # This node found by host name where SLURMD_NODENAME is not set.
    here = socket.gethostname()
    answers = {**environ, "SLURM_JOB_NODELIST": "localhost"}
    del answers["SLURMD_NODENAME"]
    if here != "localhost":
        with pytest.raises(ConfigError, match="host name"):
            from_slurm(answers)


@pytest.mark.timeout(30)
def test_gradsyncd_without_scontrol_exits_2_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_NODELIST", NODELIST)
    socket_path = f"ipc://{tmp_path}/d.sock"
    assert gradsyncd_main(["--peers-from-slurm", "--socket", socket_path, "--insecure"]) == 2
    error = capsys.readouterr().err
    assert "configuration error: --peers-from-slurm: Slurm's scontrol is not on PATH" in error


@pytest.mark.timeout(60)
def test_gradsyncd_runs_with_the_peers_slurm_gave(
    start_daemon: StartDaemon, stand_in: tuple[dict[str, str], Path],
) -> None:
    environ, log = stand_in
    [port] = free_ports(1)
    daemon = start_daemon(
        "--peers-from-slurm", "--port", str(port), "--insecure",
        env={"PATH": f"{environ['PATH']}:{os.environ['PATH']}",
             "SLURM_JOB_NODELIST": "localhost", "SLURMD_NODENAME": "localhost"},
    )
    config = fetch_snapshot(f"{daemon.endpoint}.stats", 10.0)["config"]
    assert config["listen"] == f"tcp://localhost:{port}"
    assert config["peers"] == [f"tcp://localhost:{port}"]
    assert log.read_text().splitlines() == ["show hostnames localhost"]
    assert f"peer links up on tcp://localhost:{port}" in daemon.log()


# -- a real Slurm ------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_node() -> Iterator[SlurmCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    host = socket.gethostname().split(".", 1)[0]
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        pytest.skip(f"this host's name {host!r} does not resolve; the daemons dial it")
    with SlurmCluster(nodes=1) as cluster:
        yield cluster


@pytest.fixture
def two_nodes() -> Iterator[SlurmCluster]:
    reason = skip_reason(namespaces=True)
    if reason:
        pytest.skip(reason)
    with SlurmCluster(nodes=2, namespaces=True, cpus=2) as cluster:
        yield cluster


def trained(output: str, world: int) -> list[tuple[int, str]]:
    """(rank, node) of every rank's report; each identical and equal to one process."""
    reports = TRAIN_LINE.findall(output)
    assert sorted(int(rank) for rank, *_ in reports) == list(range(world)), output
    for _rank, size, _node, identical, error in reports:
        assert int(size) == world, output
        assert identical == "true", output
        assert float(error) < 1e-4, output
    return [(int(rank), node) for rank, _size, node, *_ in reports]


def shared_dir(cluster: SlurmCluster) -> str:
    folder = cluster.folder / "shared"
    folder.mkdir(mode=0o700, exist_ok=True)
    return str(folder)


def run_train_sbatch(cluster: SlurmCluster, nodes: int, per_node: int) -> JobResult:
    """examples/slurm/train.sbatch as a user submits it, one short epoch; it succeeded."""
    job = cluster.sbatch(TRAIN_SBATCH, "--epochs", "1", cwd=str(REPO),
                         options=[f"--nodes={nodes}", f"--ntasks-per-node={per_node}"],
                         env={"GRADSYNC_SHARED_DIR": shared_dir(cluster)})
    shutil.rmtree(f"/tmp/gradsync-{job.job_id}", ignore_errors=True)  # the socket's folder
    assert job.returncode == 0, job.output + job.sbatch_stderr + cluster.logs()
    return job


def assert_cleaned_up(cluster: SlurmCluster, job_id: int, daemons: int, output: str) -> None:
    assert output.count("gradsyncd stopped") == daemons, output  # SIGTERM: clean exits
    assert output.count("ready on ipc://") == daemons, output    # one daemon per node
    assert list(Path(shared_dir(cluster)).iterdir()) == []      # the job's keys removed
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("gradsync-")
                and n.split("-")[1] in re.findall(r"gradsyncd\[(\d+)\]", output)]


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_train_sbatch_on_one_node(one_node: SlurmCluster) -> None:
    cluster = one_node
    # The real scontrol expands the node lists that gradsyncd hands it.
    assert expand_hostnames(NODELIST, cluster.env) == EXPANDED
    job = run_train_sbatch(cluster, nodes=1, per_node=2)
    assert {node for _rank, node in trained(job.output, 2)} == {cluster.nodes[0]}
    assert_cleaned_up(cluster, job.job_id, 1, job.output)


BATCH_WITHOUT_SRUN = """#!/bin/bash
#SBATCH --ntasks=2
# A plain python in the batch script, no srun: one process, although SLURM_NTASKS=2.
set -eu
export GRADSYNC_DAEMON=ipc://{folder}/gsd-$SLURM_JOB_ID.sock
{python} -m gradsync.daemon &
{python} -m gradsync.client.cli ping --wait 30
{python} {program}
kill -TERM %1
wait %1
"""


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_plain_python_in_an_sbatch_script_runs_as_a_job_of_one(
    one_node: SlurmCluster,
) -> None:
    script = one_node.folder / "no-srun.sbatch"
    script.write_text(BATCH_WITHOUT_SRUN.format(
        folder=one_node.folder, python=sys.executable, program=PROGRAMS / "env_report.py"))
    job = one_node.sbatch(script)
    assert job.returncode == 0, job.output + one_node.logs()
    [record] = [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]
    assert (record["source"], record["rank"], record["world_size"], record["sum"]) == (
        "single", 0, 1, 0)
    assert ("SLURM_NTASKS=2 is set but SLURM_STEP_ID is not: this process runs in the batch "
            "script itself") in job.output


DOCTOR_BATCH = """#!/bin/bash
#SBATCH --ntasks=1
# gradsync doctor inside a job: the job's nodes, from Slurm, probed at each port.
set -u
for port in {ports}; do
    {python} -m gradsync.client.cli doctor --json --peers-from-slurm --port $port \\
        --daemon ipc://{folder}/none.sock > {folder}/doctor-$port.json
    echo "doctor at $port: exit $?"
done
"""


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_doctor_probes_the_daemons_of_the_job_s_nodes(one_node: SlurmCluster) -> None:
    listening, closed = free_ports(2)
    with socket.create_server(("", listening)):  # where the node's daemon would listen
        script = one_node.folder / "doctor.sbatch"
        script.write_text(DOCTOR_BATCH.format(ports=f"{listening} {closed}",
                                              python=sys.executable, folder=one_node.folder))
        job = one_node.sbatch(script)
    assert job.returncode == 0, job.output + one_node.logs()
    assert f"doctor at {listening}: exit 0" in job.output, job.output
    assert f"doctor at {closed}: exit 1" in job.output, job.output
    node = one_node.nodes[0]
    for port, status in ((listening, "ok"), (closed, "problem")):
        found = {f["check"]: f for f in json.loads(
            (one_node.folder / f"doctor-{port}.json").read_text())}
        assert found[f"port tcp://{node}:{port}"]["status"] == status, found


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_train_sbatch_across_two_nodes_in_network_namespaces(two_nodes: SlurmCluster) -> None:
    cluster = two_nodes
    job = run_train_sbatch(cluster, nodes=2, per_node=1)
    # One rank on each node, each node its own host; the daemons formed one job.
    assert sorted(node for _rank, node in trained(job.output, 2)) == sorted(cluster.nodes)
    assert job.output.count("formed across 2 daemons") == 2, job.output
    assert_cleaned_up(cluster, job.job_id, 2, job.output)
