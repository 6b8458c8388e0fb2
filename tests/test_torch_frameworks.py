"""torch.distributed frameworks on backend "gradsync", unchanged.

The backend registers itself through torch's `torch.backends` entry point (so
no program here imports gradsync), takes rank and world size from what torch
is given, never from RANK/WORLD_SIZE, and runs under PyTorch Lightning's
DDPStrategy like gloo does.  Real daemons, real torch, real Lightning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cluster import free_ports

from conftest import (
    PROGRAMS,
    DaemonProcess,
    assert_all_exited_0,
    collect,
    poll_until,
    spawn_ranks,
)

torch = pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

REPO = Path(__file__).resolve().parent.parent


def fresh_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`code` in a new interpreter (nothing imported yet), with `env` added."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.timeout(150)
def test_import_torch_registers_the_backend_cheaply_and_it_can_be_turned_off() -> None:
    probe = """
        import sys, torch, torch.distributed as dist
        heavy = sorted(m for m in sys.modules if m.startswith("gradsync.client.torch.")
                       or m in ("gradsync.client.torch", "gradsync.client.client"))
        print("gradsync" in dist.Backend.backend_list, heavy)
    """
    result = fresh_python(probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "True", result.stdout
    # The creator imports the backend on first use: `import torch` loads none of it.
    assert result.stdout.strip().endswith("[]"), result.stdout
    off = fresh_python(probe, {"GRADSYNC_TORCH_AUTOLOAD": "0"})
    assert off.returncode == 0 and off.stdout.split()[0] == "False", off.stdout + off.stderr


@pytest.mark.timeout(150)
def test_a_broken_backend_module_leaves_import_torch_working_and_says_so_on_use() -> None:
    """gradsync's backend module failing to import (a broken install) must not break
    `import torch`: the failure surfaces, naming it, when a gradsync group is made."""
    result = fresh_python("""
        import importlib.abc, sys
        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "gradsync.client.torch.backend":
                    raise ImportError("simulated broken install of " + name)
                return None
        sys.meta_path.insert(0, Broken())
        import torch, torch.distributed as dist
        print("imported", "gradsync" in dist.Backend.backend_list)
        store = dist.HashStore()
        try:
            dist.init_process_group("gradsync", store=store, rank=0, world_size=1)
        except Exception as exc:
            print("refused:", type(exc).__name__, exc)
    """)
    assert result.returncode == 0, result.stderr
    assert "imported True" in result.stdout, result.stdout
    assert "simulated broken install of gradsync.client.torch.backend" in result.stdout


@pytest.mark.timeout(150)
def test_a_program_that_never_imports_gradsync_and_passes_its_rank_itself(
    daemon: DaemonProcess, short_tmp: str,
) -> None:
    """No RANK in the environment, WORLD_SIZE present (Lightning's first process):
    the backend takes rank and size from init_process_group; object collectives
    (all_gather_object, broadcast_object_list) run on it."""
    init = f"file://{short_tmp}/store"
    results = collect(spawn_ranks(daemon.endpoint, "torch_plain_ranks.py", 2, [init]), 120)
    assert_all_exited_0(results)
    records = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    for record in records:
        assert record["registered"] and record["loaded_before_init"] == []
        assert record["sum"] == 3.0
        assert record["gathered"] == [{"rank": 0, "text": ""}, {"rank": 1, "text": "x" * 100}]
        assert record["broadcast"] == [{"from": 1, "values": [0, 1, 2, 3, 4]}]


def lightning_fit(
    backend: str, out: Path, env: dict[str, str], script: Path
) -> dict[int, list[float]]:
    """Run tests/programs/lightning_fit.py or fabric_fit.py (Lightning starts the
    second process)."""
    result = subprocess.run(
        [sys.executable, str(script), backend, str(out)], capture_output=True,
        text=True, timeout=240, env={**os.environ, **env}, cwd=out.parent,
    )
    assert result.returncode == 0, f"{backend}:\n{result.stdout}\n{result.stderr}"
    return {rank: json.loads((out.parent / f"{out.name}.{rank}").read_text())
            for rank in (0, 1)}


@pytest.mark.frameworks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ["lightning_fit.py", "fabric_fit.py"])
def test_lightning_ddp_strategy_trains_like_gloo(
    daemon: DaemonProcess, tmp_path: Path, script: str
) -> None:
    """Lightning's Trainer and Lightning Fabric, each with its DDPStrategy."""
    pytest.importorskip("lightning", reason="Lightning is installed by the dev extra")
    port = free_ports(1)[0]
    env = {"GRADSYNC_DAEMON": daemon.endpoint, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    ours = lightning_fit("gradsync", tmp_path / "gradsync", env, PROGRAMS / script)
    env["MASTER_PORT"] = str(free_ports(1)[0])
    theirs = lightning_fit("gloo", tmp_path / "gloo", env, PROGRAMS / script)
    assert ours[0] == ours[1], "the two ranks' parameters differ"
    assert theirs[0] == theirs[1]
    worst = max(abs(a - b) for a, b in zip(ours[0], theirs[0], strict=True))
    assert worst <= 1e-6, f"gradsync and gloo runs differ by {worst}"


@pytest.mark.frameworks
@pytest.mark.alone  # Ray's dozen of processes took 4x as long beside another worker's test
@pytest.mark.timeout(300)
def test_ray_train_torch_trainer_on_gradsync_with_no_daemon_set_up(
    tmp_path: Path, short_tmp: str
) -> None:
    """TorchTrainer with TorchConfig(backend="gradsync"): Ray's workers form the group
    themselves, the backend starts the node's daemon, DDP trains as one process
    would, and the daemon leaves with the job."""
    pytest.importorskip("ray.train", reason="Ray Train is installed by the dev extra")
    runtime = short_tmp  # the daemon's folder goes here (XDG_RUNTIME_DIR)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.update(XDG_RUNTIME_DIR=runtime, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    script = str(PROGRAMS / "ray_train_fit.py")
    for backend in ("gradsync", "reference"):
        result = subprocess.run([sys.executable, script, backend, str(tmp_path / backend)],
                                capture_output=True, text=True, timeout=240, env=env)
        assert result.returncode == 0, f"{backend}:\n{result.stdout}\n{result.stderr[-6000:]}"
    workers = [json.loads((tmp_path / f"gradsync.{rank}").read_text()) for rank in (0, 1)]
    reference = json.loads((tmp_path / "reference.0").read_text())["params"]
    assert [w["backend"] for w in workers] == ["gradsync", "gradsync"], workers
    assert workers[0]["params"] == workers[1]["params"], "the two workers' parameters differ"
    worst = max(abs(a - b) for a, b in zip(workers[0]["params"], reference, strict=True))
    assert worst <= 1e-10, f"Ray Train on gradsync and one process differ by {worst}"
    pids = {int(w["daemon_pid"]) for w in workers}
    assert len(pids) == 1, f"one node, one private daemon: {pids}"
    poll_until(lambda: all(not os.path.exists(f"/proc/{p}") for p in pids), 30.0,
               f"the private gradsyncd {pids} exits after Ray's workers")
    assert os.listdir(runtime) == [], os.listdir(runtime)


def framework_calls(daemon: DaemonProcess, scenario: str, world: int,
                    *args: str) -> list[dict[str, object]]:
    """tests/programs/torch_framework_calls.py SCENARIO on `world` env:// ranks."""
    port = free_ports(1)[0]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    ranks = spawn_ranks(daemon.endpoint, "torch_framework_calls.py", world, [scenario, *args],
                        env=env)
    results = collect(ranks, 150)
    assert_all_exited_0(results)
    return [result.records()[-1] for result in results]


@pytest.mark.timeout(180)
def test_monitored_barrier_names_the_rank_held_back(daemon: DaemonProcess) -> None:
    records = framework_calls(daemon, "monitored_barrier", 3)
    for record in records[:2]:
        assert record["error"] is not None, record
        assert "ranks [2] of process group" in str(record["error"]), record
        assert "did not arrive within 1.5s" in str(record["error"]), record
        # gloo's words first: torch's own tests look for them.
        assert str(record["error"]).startswith(
            "Rank 2 failed to pass monitoredBarrier in 1500 ms"), record
        # It fails at its own timeout, not the group's (60 s).
        assert 1.4 <= float(record["waited_s"]) < 30, record  # type: ignore[arg-type]
    assert records[2]["error"] is None


@pytest.mark.frameworks
@pytest.mark.timeout(240)
def test_dcp_saves_and_loads_a_sharded_fsdp2_state_dict(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    records = framework_calls(daemon, "dcp", 2, str(tmp_path / "checkpoint"))
    for record in records:
        assert record["keys"] == [f"{i}.{p}" for i in range(4) for p in ("bias", "weight")]
        assert record["sharded"], "FSDP2 did not shard the parameters"
        assert record["differed_before"], "the fresh model already held the saved values"
        assert record["equal_after"], record
    assert any(name.endswith(".distcp") for name in os.listdir(tmp_path / "checkpoint"))


@pytest.mark.frameworks
@pytest.mark.timeout(240)
def test_pipelining_gpipe_over_send_recv_matches_the_whole_model(daemon: DaemonProcess) -> None:
    records = framework_calls(daemon, "pipelining", 2)
    assert [r["grads_match"] for r in records] == [True, True], records
    assert records[0]["losses"] == [] and len(records[1]["losses"]) == 4  # type: ignore[arg-type]


def accelerate_run(backend: str, runtime: Path, out: Path) -> list[dict[str, object]]:
    """tests/programs/accelerate_train.py on 2 ranks under torchrun, no daemon set up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    port = free_ports(1)[0]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         str(PROGRAMS / "accelerate_train.py"), backend, str(out)],
        capture_output=True, text=True, timeout=240,
        env={**env, "XDG_RUNTIME_DIR": str(runtime), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"{backend}:\n{result.stdout}\n{result.stderr[-4000:]}"
    # A program that never destroys its group leaves the job in order at exit.
    assert "died" not in result.stderr, result.stderr[-4000:]
    return [json.loads(out.with_name(f"{out.name}.{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.frameworks
@pytest.mark.timeout(400)
def test_accelerate_under_torchrun_trains_bitwise_like_gloo(
    short_tmp: str, tmp_path: Path
) -> None:
    pytest.importorskip("accelerate", reason="accelerate is installed by the dev extra")
    ours = accelerate_run("gradsync", Path(short_tmp), tmp_path / "gradsync")
    theirs = accelerate_run("gloo", Path(short_tmp), tmp_path / "gloo")
    assert [(r["backend"], r["type"], r["model"]) for r in ours] == [
        ("gradsync", "DistributedType.MULTI_CPU", "DistributedDataParallel")] * 2
    assert ours[0]["params"] == ours[1]["params"], "the two ranks' parameters differ"
    assert ours[0]["params"] == theirs[0]["params"], "gradsync and gloo runs differ"
    assert ours[0]["losses"] == theirs[0]["losses"]
    poll_until(lambda: os.listdir(short_tmp) == [], 30.0,
               "the job's private daemon leaves, removing its folder")
