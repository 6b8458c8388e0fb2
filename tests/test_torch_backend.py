"""torch.distributed on backend "gradsync": torch's own collectives, DDP, FSDP2 and DeviceMesh.

Rank programs (tests/programs/torch_backend_ranks.py) call
`init_process_group("gradsync")` and check every primitive against values each
rank computes alone, and train with torch's DDP and FSDP2 against one process.
Real daemons, real torch, real launchers (env://, tcp://, file://, torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import free_ports, peer_args, run_spread, spawn_spread

from conftest import (
    PROGRAMS,
    DaemonProcess,
    RankResult,
    assert_all_exited_0,
    collect,
    records_by_scenario,
    run_ranks,
    spawn_ranks,
)

torch = pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

StartDaemon = Callable[..., DaemonProcess]

PRIMITIVES = "primitives,groups,functional,sharing,errors,on_page"
#: Largest |parameter - single-process reference| per training scenario.
TOLERANCE = {
    "ddp": 1e-10,
    "ddp_no_sync": 1e-10,
    "ddp_unused": 1e-10,
    "ddp_fp16": 1e-3,
    "fsdp": 1e-5,
    "fsdp_bf16": 5e-3,
    "hsdp": 1e-5,
    "fsdp_daemon_memory": 1e-5,
}
#: Lossy on purpose: only agreement between ranks is checked.
AGREE_ONLY = ["ddp_powersgd"]


def rendezvous_env(init: str | None = None) -> dict[str, str]:
    """env:// on a free port, or GRADSYNC_TEST_INIT for the rank program."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])}
    if init is not None:
        env["GRADSYNC_TEST_INIT"] = init
    return env


def check(results: list[RankResult], scenarios: list[str]) -> None:
    """Every scenario ran on every rank; training within tolerance and identical everywhere."""
    by_scenario = records_by_scenario(results, scenarios)
    for name, records in by_scenario.items():
        if "checks" in records[0]:
            assert all(int(r["checks"]) > 0 for r in records), records
        if "digest" in records[0]:
            assert len({r["digest"] for r in records}) == 1, f"{name}: ranks differ: {records}"
        if name in TOLERANCE:
            worst = max(float(r["err"]) for r in records)
            assert worst <= TOLERANCE[name], f"{name}: max error {worst:.3g}: {records}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nranks", [2, 4])
def test_every_primitive_matches_its_reference_on_one_daemon(
    daemon: DaemonProcess, nranks: int
) -> None:
    scenarios = PRIMITIVES.split(",")
    results = run_ranks(daemon.endpoint, "torch_backend_ranks.py", nranks, [PRIMITIVES],
                        timeout_s=140, env=rendezvous_env())
    check(results, scenarios)


@pytest.mark.timeout(150)
def test_torch_ddp_and_fsdp2_train_like_one_process(daemon: DaemonProcess) -> None:
    scenarios = [*TOLERANCE, *AGREE_ONLY]
    results = run_ranks(daemon.endpoint, "torch_backend_ranks.py", 2, [",".join(scenarios)],
                        timeout_s=140, env=rendezvous_env())
    check(results, scenarios)


def curve_args(folder: Path, endpoints: list[str]) -> list[list[str]]:
    """Per daemon: the flags of a CURVE-authenticated cluster (keys made by keygen)."""
    keys = folder / "keys"
    keys.mkdir(mode=0o700)
    for index, endpoint in enumerate(endpoints):
        subprocess.run([sys.executable, "-m", "gradsync.client.cli", "keygen", str(keys),
                        "--name", f"node{index}", "--endpoint", endpoint], check=True,
                       capture_output=True)
    authorized = folder / "authorized"
    authorized.mkdir(mode=0o700)
    for index in range(len(endpoints)):
        os.link(keys / f"node{index}.key", authorized / f"node{index}.key")
    return [["--curve-secret", str(keys / f"node{i}.key_secret"),
             "--curve-authorized", str(authorized)] for i in range(len(endpoints))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("security, spread", [("insecure", (1, 1)), ("curve", (2, 1))])
def test_across_two_daemons(
    start_daemon: StartDaemon, short_tmp: str, security: str, spread: tuple[int, int]
) -> None:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    extra = ([["--insecure"]] * 2 if security == "insecure"
             else curve_args(Path(short_tmp), endpoints))
    daemons = [start_daemon(*peer_args(i, endpoints, *extra[i])) for i in range(2)]
    scenarios = ["primitives", "functional", "ddp", "ddp_unused", "fsdp", "hsdp"]
    results = run_spread(daemons, spread, "torch_backend_ranks.py", [",".join(scenarios)],
                         timeout_s=220, env=rendezvous_env())
    check(results, scenarios)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("init", ["tcp", "file"])
def test_tcp_and_file_init_methods(daemon: DaemonProcess, short_tmp: str, init: str) -> None:
    """Also: with GRADSYNC_TORCH_SHARE=0 no tensor moves to shared memory."""
    method = (f"tcp://127.0.0.1:{free_ports(1)[0]}" if init == "tcp"
              else f"file://{short_tmp}/store")
    results = run_ranks(daemon.endpoint, "torch_backend_ranks.py", 2, ["smoke,sharing"],
                        timeout_s=80, env={**rendezvous_env(method), "GRADSYNC_TORCH_SHARE": "0"})
    check(results, ["smoke", "sharing"])


@pytest.mark.timeout(120)
def test_torchrun_launches_ranks_on_a_running_daemon(
    daemon: DaemonProcess, short_tmp: str
) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    logs = Path(short_tmp) / "torchrun"
    process = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_ports(1)[0]),
         "--log-dir", str(logs), "--redirects", "1",  # each rank's stdout to its own file
         str(PROGRAMS / "torch_backend_ranks.py"), "smoke,primitives"],
        env={**os.environ, "GRADSYNC_DAEMON": daemon.endpoint, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=110,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    outputs = sorted(logs.rglob("stdout.log"))
    assert len(outputs) == 2, outputs
    records = [json.loads(line) for path in outputs
               for line in path.read_text().splitlines() if line.startswith("{")]
    assert sorted((r["scenario"], r["rank"]) for r in records) == [
        ("primitives", 0), ("primitives", 1), ("smoke", 0), ("smoke", 1)
    ], process.stdout


@pytest.mark.timeout(120)
def test_gradsync_launch_runs_an_unchanged_torch_script(daemon: DaemonProcess) -> None:
    """The launcher sets MASTER_ADDR/MASTER_PORT, so env:// needs nothing else."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    process = subprocess.run(
        [sys.executable, "-m", "gradsync.client.cli", "launch", "--nproc-per-node", "2",
         "--daemon", daemon.endpoint, str(PROGRAMS / "torch_backend_ranks.py"), "smoke"],
        env=env, capture_output=True, text=True, timeout=110,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    records = [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in records) == [0, 1], process.stdout


@pytest.mark.timeout(150)
def test_two_torch_jobs_share_one_daemon_at_the_same_time(daemon: DaemonProcess) -> None:
    """Same GRADSYNC_JOB, separate stores: the store-made job names keep them apart."""
    jobs = [spawn_ranks(daemon.endpoint, "torch_backend_ranks.py", 2, ["primitives"],
                        job="same", env=rendezvous_env()) for _ in range(2)]
    for processes in jobs:
        results = collect(processes, 140)
        assert_all_exited_0(results, daemon.log()[-3000:])
        check(results, ["primitives"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["one daemon", "two daemons"])
def test_a_killed_rank_makes_the_others_raise_within_the_timeout(
    start_daemon: StartDaemon, layout: str
) -> None:
    if layout == "one daemon":
        daemons = [start_daemon()]
        processes = spawn_ranks(daemons[0].endpoint, "torch_backend_fail.py", 3,
                                env={**rendezvous_env(), "GRADSYNC_TEST_TIMEOUT_S": "40",
                                     "GRADSYNC_TEST_DAEMONS": daemons[0].endpoint})
    else:
        endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
        daemons = [start_daemon(*peer_args(i, endpoints, "--insecure")) for i in range(2)]
        processes = spawn_spread(daemons, (2, 1), "torch_backend_fail.py",
                                 env={**rendezvous_env(), "GRADSYNC_TEST_TIMEOUT_S": "40",
                                      "GRADSYNC_TEST_DAEMONS": ",".join(
                                          daemon.endpoint for daemon in daemons)})
    results = collect(processes, 110)
    assert results[-1].returncode == -9
    for result in results[:-1]:
        assert result.returncode == 0, result.stdout + result.stderr
        (outcome,) = result.records()
        assert outcome["error"] == "DistBackendError", outcome
        assert outcome["step"] == 3 and outcome["seconds"] < 40, outcome
        assert "rank 2" in outcome["message"], outcome
        # gloo's phrase too, which torch's and torchft's tools look for.
        assert "Connection closed by peer" in outcome["message"], outcome
        assert "aborted" in outcome["message"], outcome
    for daemon in daemons:
        daemon.assert_alive()
