"""The command lines import what a command needs, when it needs it.

numpy (for `Client`; ml_dtypes only for bfloat16), ZeroMQ (for the statistics
endpoint and keys), torch and cupy cost more than a command such as `gradsync
ping` spends in all.  Each case runs one entry point in a fresh interpreter, as its console
script would, and then lists which of those modules the process holds: a
property of the code, not a clock reading.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import free_ports, peer_args

from conftest import DaemonProcess

pytestmark = pytest.mark.timeout(60)

#: The modules no command of this file needs; `NEEDS` lifts them case by case.
HEAVY = ("numpy", "ml_dtypes", "torch", "cupy", "zmq")

#: Runs MODULE's `main(argv)` and prints, as its last line, the exit status and
#: which of HEAVY the process imported.
PROBE = """
import json, sys
from {module} import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
print("\\n" + json.dumps({{"code": code, "loaded": [m for m in {heavy!r} if m in sys.modules]}}))
"""

CLI = "gradsync.client.cli"
DAEMON = "gradsync.daemon.main"
PROGRAMS = {CLI: "gradsync", DAEMON: "gradsyncd"}


def probe(module: str, *argv: str) -> tuple[object, list[str]]:
    """(exit status, heavy modules loaded) of `main(argv)` of MODULE in a new process."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, heavy=HEAVY), *argv],
        capture_output=True, text=True, timeout=50, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    return report["code"], report["loaded"]


HELP_AND_VERSION = [
    *[(CLI, [flag]) for flag in ("--help", "--version")],
    *[(CLI, [command, "--help"])
      for command in ("launch", "demo", "keygen", "stats", "top", "trace", "ping", "doctor",
                      "bench")],
    *[(DAEMON, [flag]) for flag in ("--help", "--version")],
]


@pytest.mark.parametrize(
    ("module", "argv"),
    [pytest.param(module, argv, id=" ".join([PROGRAMS[module], *argv]))
     for module, argv in HELP_AND_VERSION],
)
def test_help_and_version_import_nothing_heavy(module: str, argv: list[str]) -> None:
    assert probe(module, *argv) == (0, [])


def test_ping_imports_nothing_heavy(daemon: DaemonProcess) -> None:
    assert probe(CLI, "ping", "--daemon", daemon.endpoint) == (0, [])


def test_ping_with_no_daemon_imports_nothing_heavy(short_tmp: str) -> None:
    assert probe(CLI, "ping", "--daemon", f"ipc://{short_tmp}/none.sock") == (1, [])


def test_launch_imports_nothing_heavy_in_the_launcher(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text("import numpy\n")  # the ranks may; the launcher need not
    argv = ["launch", "--nproc-per-node", "2", "--daemon", daemon.endpoint, str(script)]
    assert probe(CLI, *argv) == (0, [])


def test_stats_and_keygen_import_only_zeromq(daemon: DaemonProcess, tmp_path: Path) -> None:
    assert probe(CLI, "stats", "--daemon", daemon.endpoint, "--json") == (0, ["zmq"])
    keys = str(tmp_path / "keys")
    assert probe(CLI, "keygen", keys, "--name", "reader", "--reader") == (0, ["zmq"])
    assert (tmp_path / "keys" / "reader.key_secret").exists()


def test_the_client_package_loads_client_work_and_reduce_op_on_first_use() -> None:
    code = (
        "import sys\n"
        "import gradsync.client as package\n"
        "assert 'numpy' not in sys.modules and 'ml_dtypes' not in sys.modules\n"
        "from gradsync.client import *\n"
        "from gradsync.client.client import Client as C\n"
        "from gradsync.client.work import Work as W\n"
        "from gradsync.protocol.dtypes import ReduceOp as R\n"
        "assert (Client, Work, ReduceOp) == (C, W, R)\n"
        "assert all(hasattr(package, name) for name in package.__all__)\n"
        "assert not hasattr(package, 'Nonexistent')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=50, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr


def test_a_client_loads_ml_dtypes_only_for_bfloat16(daemon: DaemonProcess) -> None:
    """Importing ml_dtypes costs about a second, which every rank process paid on
    `from gradsync.client import Client`; only a bfloat16 array needs it."""
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from gradsync.client import Client\n"
        "from gradsync.protocol.dtypes import DTYPES\n"
        "with Client(sys.argv[1], job='lazy', rank=0, world_size=1) as client:\n"
        "    array = client.empty(4, np.float32); array[:] = 1.5\n"
        "    client.all_reduce(array)\n"
        "    assert (array == 1.5).all() and 'ml_dtypes' not in sys.modules\n"
        "    half = client.empty(4, DTYPES['bfloat16']); half[:] = 2.0\n"
        "    client.all_reduce(half, op='max')\n"
        "    assert (half == 2.0).all() and 'ml_dtypes' in sys.modules\n"
    )
    run_client(code, daemon.endpoint)


def test_a_torch_job_loads_ml_dtypes_only_for_bfloat16(daemon: DaemonProcess) -> None:
    """Every process of a torch job imports the backend (`gradsync.client.torch`); it
    paid ml_dtypes' half second of CPU at import until the bfloat16 lookups went
    through `protocol.dtypes.DTYPES`, which loads it for the first bfloat16 tensor."""
    pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")
    code = (
        "import os, sys\n"
        "import torch, torch.distributed as dist\n"
        "from gradsync.client.torch import DistributedDataParallel\n"
        "os.environ['GRADSYNC_DAEMON'] = sys.argv[1]\n"
        "dist.init_process_group('gradsync', store=dist.HashStore(), rank=0, world_size=1)\n"
        "model = DistributedDataParallel(torch.nn.Linear(4, 2))\n"
        "model(torch.ones(3, 4)).sum().backward()\n"
        "tensor = torch.full((4,), 1.5)\n"
        "dist.all_reduce(tensor)\n"
        "assert (tensor == 1.5).all() and 'ml_dtypes' not in sys.modules\n"
        "half = torch.full((4,), 2.0, dtype=torch.bfloat16)\n"
        "dist.all_reduce(half, op=dist.ReduceOp.MAX)\n"
        "assert (half == 2.0).all() and 'ml_dtypes' in sys.modules\n"
        "dist.destroy_process_group()\n"
    )
    run_client(code, daemon.endpoint)


def run_client(code: str, endpoint: str) -> None:
    """Run `code` (a client of the daemon at argv[1]) in a fresh interpreter; it must pass."""
    result = subprocess.run([sys.executable, "-c", code, endpoint], capture_output=True,
                            text=True, timeout=50, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr


def holds_ml_dtypes(pid: int) -> bool:
    """Whether a process has mapped ml_dtypes' extension (from /proc/PID/maps)."""
    return "_ml_dtypes_ext" in Path(f"/proc/{pid}/maps").read_text()


def test_a_single_node_daemon_loads_ml_dtypes_at_its_first_bfloat16_request(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Loading it costs about a second of start-up; a daemon with peers pays it before
    it says ready (a pause on its event loop later could look like a dead peer)."""
    single = start_daemon()
    assert not holds_ml_dtypes(single.process.pid)
    code = (
        "import sys\n"
        "import ml_dtypes, numpy as np\n"
        "from gradsync.client import Client\n"
        "with Client(sys.argv[1], job='half', rank=0, world_size=1) as client:\n"
        "    half = np.full(4, 3.0, dtype=ml_dtypes.bfloat16)\n"
        "    work = client.all_reduce(half, op='sum', async_op=True)\n"
        "    assert work is not None and work.wait() and (half == 3.0).all()\n"
    )
    run_client(code, single.endpoint)
    assert holds_ml_dtypes(single.process.pid)
    (endpoint,) = [f"tcp://127.0.0.1:{port}" for port in free_ports(1)]
    peered = start_daemon(*peer_args(0, [endpoint], "--insecure"))
    assert holds_ml_dtypes(peered.process.pid)
