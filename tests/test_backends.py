"""The buffer backend seam, and device requests on a machine without a GPU.

The CUDA backend itself needs a GPU (benchmarks/gpu_check.py runs it); here:
the host backend behind the seam, the CPU path never importing cupy (a
tripwire module stands in for cupy and records any import), device requests
answered with clear errors while the daemon keeps serving, and the checks the
client and the DDP wrapper make before touching a device.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import DaemonProcess, assert_all_exited_0, run_ranks
from gradsync.client import Client
from gradsync.client.connection import Connection
from gradsync.daemon.backends import Buffers
from gradsync.protocol.errors import GradsyncError, InvalidArgumentError, ProtocolError
from gradsync.protocol.shm import SHM_DIR

HAVE_CUPY = importlib.util.find_spec("cupy") is not None
TRIPWIRE = '''
import os, traceback
with open(os.environ["CUPY_TRIPWIRE"], "a") as marker:
    marker.write(f"pid {os.getpid()} imported cupy:\\n" + "".join(traceback.format_stack()))
raise ImportError("cupy is a tripwire in this test")
'''


def introduce(endpoint: str, job: str) -> Connection:
    connection = Connection(endpoint)
    connection.call("hello", job=job, rank=0, world_size=1, local_rank=0,
                    local_world_size=1, pid=os.getpid())
    return connection


def test_host_slabs_share_one_numbering_and_budget() -> None:
    buffers = Buffers(max_bytes=1 << 20)
    try:
        first = buffers.allocate(5000, "rank 0 of job 't'", {})
        second = buffers.allocate(4096, "rank 1 of job 't'", {"device": None})
        assert first.segment_id != second.segment_id
        assert buffers.get(first.segment_id) is first and len(buffers) == 2
        assert buffers.in_use == first.nbytes + second.nbytes == 8192 + 4096
        view = first.view(8, 3, np.dtype(np.float64))
        view[:] = [1.0, 2.0, 3.0]
        assert first.view(8, 3, np.dtype(np.float64)).tolist() == [1.0, 2.0, 3.0]
        name = first.backend.export(first)["name"]
        assert os.path.exists(os.path.join(SHM_DIR, name))
        hosts, copy_back = first.backend.to_host([view], np.dtype(np.float64))
        assert hosts[0] is view  # host memory is sent as it is
        copy_back()()  # queue the copies back, then wait for them
        buffers.release(first.segment_id)
        assert not os.path.exists(os.path.join(SHM_DIR, name))
        # Still mapped while a view of it lives, and counted as in use until then.
        assert buffers.get(first.segment_id) is None and buffers.in_use == 8192 + 4096
        del view, hosts, first
        assert buffers.in_use == 4096
    finally:
        buffers.release_all()
    assert buffers.in_use == 0 and len(buffers) == 0


@pytest.mark.timeout(300)
def test_the_cpu_path_never_imports_cupy(start_daemon: object, short_tmp: str) -> None:
    """Collectives, DDP and the stats all run with cupy booby-trapped; a device
    request then trips it, which shows the trap works."""
    trap = Path(short_tmp) / "trap"
    (trap / "cupy").mkdir(parents=True)
    (trap / "cupy" / "__init__.py").write_text(TRIPWIRE)
    marker = Path(short_tmp) / "cupy-imported"
    env = {"PYTHONPATH": os.pathsep.join([str(trap), os.environ.get("PYTHONPATH", "")]),
           "CUPY_TRIPWIRE": str(marker)}
    daemon: DaemonProcess = start_daemon(env=env)  # type: ignore[operator]
    results = run_ranks(daemon.endpoint, "collectives_matrix.py", 2, ["all_gather,reduce"],
                        timeout_s=240, env=env)
    assert_all_exited_0(results)
    results = run_ranks(daemon.endpoint, "ddp_train.py", 2, ["f32,bfloat16"], timeout_s=240,
                        env=env)
    assert_all_exited_0(results)
    assert not marker.exists(), marker.read_text()

    connection = introduce(daemon.endpoint, "trap")
    try:
        with pytest.raises(InvalidArgumentError, match="cannot serve device buffers"):
            connection.call("alloc", nbytes=4096, device=0)
    finally:
        connection.close()
    assert f"pid {daemon.pid} imported cupy" in marker.read_text()


@pytest.mark.timeout(120)
@pytest.mark.skipif(HAVE_CUPY, reason="cupy is installed: device requests may succeed here")
def test_device_requests_without_cupy_fail_clearly_and_nothing_breaks(
    daemon: DaemonProcess,
) -> None:
    connection = introduce(daemon.endpoint, "gpu-less")
    try:
        for _ in range(2):  # the second answer comes from the remembered reason
            with pytest.raises(InvalidArgumentError, match="cupy is not installed"):
                connection.call("alloc", nbytes=4096, device=0)
        reply = connection.call("alloc", nbytes=4096)
        assert reply["nbytes"] == 4096 and reply["name"].startswith("gradsync-")
    finally:
        connection.close()
    for fields in ({"device": True}, {"device": 0, "event": "not bytes"}):
        malformed = introduce(daemon.endpoint, "malformed")
        try:
            with pytest.raises(ProtocolError, match="'alloc' field"):
                malformed.call("alloc", nbytes=4096, **fields)
        finally:
            malformed.close()

    with Client(daemon=daemon.endpoint, job="after", rank=0, world_size=1, local_rank=0,
                local_world_size=1) as client:
        with pytest.raises(InvalidArgumentError, match="need cupy"):
            client.empty(16, np.float32, device="cuda:0")
        with pytest.raises(InvalidArgumentError, match="CUDA device"):
            client.empty(16, np.float32, device="gpu")
        with pytest.raises(InvalidArgumentError, match="needs a device"):
            client.empty(16, np.float32, like="torch")
        with pytest.raises(InvalidArgumentError, match="CUDA tensor or a cupy array"):
            client.all_reduce(torch.ones(4))  # type: ignore[arg-type]
        array = client.empty(4, np.float32)
        array[:] = 3.0
        client.all_reduce(array)  # the host path is untouched
        assert array.tolist() == [3.0] * 4


@pytest.mark.timeout(60)
def test_ddp_refuses_a_module_spread_over_devices(daemon: DaemonProcess) -> None:
    from gradsync.client.torch import DistributedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with (
        Client(daemon=daemon.endpoint, job="spread", rank=0, world_size=1, local_rank=0,
               local_world_size=1) as client,
        pytest.raises(GradsyncError, match="on the CPU or on one CUDA device"),
    ):
        DistributedDataParallel(model, client=client)
