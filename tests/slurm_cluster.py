"""A real Slurm for tests: munged, slurmctld and slurmd as child processes of the test.

`SlurmCluster` writes a MUNGE key and a `slurm.conf` into a private folder,
starts the three daemons in the foreground (not as services), waits until
`sinfo` shows every node idle, submits batch scripts with `sbatch --wait`, and
stops everything it started, job processes included.

Two layouts:

- one node on 127.0.0.1, named after this host (its name must resolve, since
  the gradsync daemons dial `tcp://NODE:PORT`);
- `Namespaces`: each slurmd in a network and UTS namespace of its own (its own
  host name and address), slurmctld in a third that holds the bridge joining
  them.  Every address is one this harness assigns inside namespaces it
  creates; names resolve through a hosts file of the harness's, mounted over
  `/etc/hosts` in a private mount namespace of each daemon, where each node
  also has a /tmp of its own.  One munged serves all: its socket is a file,
  which network namespaces do not separate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from cluster import free_ports

from conftest import poll_until

#: What a test needs on PATH to run a Slurm of its own.
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel",
                  "scontrol")
NAMESPACE_PROGRAMS = ("ip", "nsenter", "unshare", "mount")
REPO = Path(__file__).resolve().parent.parent
#: Marks every process of one cluster (daemons, job steps), so teardown finds them all.
MARK = "GRADSYNC_TEST_SLURM"
_START_TIMEOUT_S = 60.0


def missing_programs() -> list[str]:
    return [name for name in SLURM_PROGRAMS if shutil.which(name) is None]


def skip_reason(namespaces: bool = False) -> str | None:
    """Why a real Slurm cannot run here, or None."""
    missing = missing_programs()
    if missing:
        return (f"needs Slurm and MUNGE ({', '.join(missing)} not on PATH): "
                "apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        return "needs root: slurmd starts job steps as their user"
    missing = [name for name in NAMESPACE_PROGRAMS if shutil.which(name) is None]
    if namespaces and missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux) for the namespaces"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclasses.dataclass
class Namespaces:
    """A bridge in the controller's namespace and one namespace per node, veths between."""

    tag: str
    subnet: str
    nodes: tuple[str, ...]
    hosts_file: Path
    created: list[str] = dataclasses.field(default_factory=list)

    @property
    def controller(self) -> str:
        return f"gsc{self.tag}"

    def namespace(self, node: str) -> str:
        return f"{node}ns"

    def address(self, index: int) -> str:
        """Host addresses: .1 the controller, .11, .12, ... the nodes."""
        return f"{self.subnet}.{1 if index < 0 else 11 + index}"

    def hosts(self) -> str:
        lines = ["127.0.0.1 localhost", f"{self.address(-1)} {self.controller}"]
        lines += [f"{self.address(i)} {node}" for i, node in enumerate(self.nodes)]
        return "\n".join(lines) + "\n"

    def create(self) -> None:
        bridge = f"gsbr{self.tag}"
        everyone = [self.controller, *(self.namespace(n) for n in self.nodes)]
        self.hosts_file.write_text(self.hosts())
        for name in everyone:
            _ip("netns", "add", name)
            self.created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        ctl = self.controller
        _ip("-n", ctl, "link", "add", bridge, "type", "bridge")
        _ip("-n", ctl, "addr", "add", f"{self.address(-1)}/24", "dev", bridge)
        _ip("-n", ctl, "link", "set", bridge, "up")
        for index, node in enumerate(self.nodes):
            outer, inner = f"gsv{self.tag}{index}", f"gsw{self.tag}{index}"
            # Made inside the controller's namespace, so no link ever lives in the host's.
            _ip("-n", ctl, "link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("-n", ctl, "link", "set", inner, "netns", self.namespace(node))
            _ip("-n", ctl, "link", "set", outer, "master", bridge)
            _ip("-n", ctl, "link", "set", outer, "up")
            _ip("-n", self.namespace(node), "addr", "add", f"{self.address(index)}/24",
                "dev", inner)
            _ip("-n", self.namespace(node), "link", "set", inner, "up")

    def remove(self) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self.created.clear()

    def enter(self, name: str, hostname: str | None = None) -> list[str]:
        """A command prefix: run in namespace `name`, seeing `hosts` as /etc/hosts and, if
        given, with its own host name.

        Not `ip netns exec`: it mounts a fresh /sys without /sys/fs/cgroup, and
        slurmd 22.05 will not start without its cgroup plugin.  The mount
        namespace of `unshare` is private, so its mounts stay inside it and go
        when its last process (slurmd, slurmstepd, the tasks) has ended.
        """
        prefix = ["nsenter", f"--net=/run/netns/{name}"]
        if hostname is None:
            return prefix
        # A /tmp of its own, as a real node has: train.sbatch's socket path is per job,
        # not per node.  What the jobs need from the real /tmp (a checkout or venv
        # there, as in CI) is bound aside first and back into the new /tmp after.
        held = _under_tmp([REPO, Path(sys.prefix)])
        hold = self.hosts_file.parent / f"held-{hostname}"
        aside = [f"mkdir -p {hold}/{i} && mount --bind {path} {hold}/{i}"
                 for i, path in enumerate(held)]
        back = [f"mkdir -p {path} && mount --bind {hold}/{i} {path}"
                for i, path in enumerate(held)]
        setup = " && ".join([
            f"mount --bind {self.hosts_file} /etc/hosts", *aside,
            "mount -t tmpfs -o mode=1777 gradsync-test-tmp /tmp", *back,
            f"hostname {hostname}",
        ])
        return [*prefix, "unshare", "--mount", "--uts", "sh", "-c", setup + ' && exec "$@"',
                "-"]


def _under_tmp(paths: Sequence[Path]) -> list[Path]:
    """The outermost of `paths` that lie under /tmp (nested ones come with them)."""
    inside = sorted({p.resolve() for p in paths if p.resolve().is_relative_to("/tmp")})
    return [p for p in inside if not any(p != q and p.is_relative_to(q) for q in inside)]


@dataclasses.dataclass
class JobResult:
    job_id: int
    returncode: int
    output: str
    sbatch_stderr: str


class SlurmCluster:
    """munged + slurmctld + slurmd(s) in a private folder; use as a context manager."""

    def __init__(self, nodes: int = 1, namespaces: bool = False, cpus: int = 4) -> None:
        # Namespaced nodes get a /tmp of their own: what they share lives elsewhere.
        self.folder = Path(tempfile.mkdtemp(prefix="gs-slurm-",
                                            dir="/var/tmp" if namespaces else "/tmp"))
        os.chmod(self.folder, 0o755)  # job steps of any user read the config
        self.tag = f"{os.getpid() % 10000}"
        self.mark = f"{self.tag}-{random.randrange(1 << 30)}"
        self.cpus = cpus
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.netns: Namespaces | None = None
        if namespaces:
            names = tuple(f"gsn{self.tag}x{i}" for i in range(nodes))
            self.netns = Namespaces(self.tag, f"10.214.{random.randrange(1, 250)}", names,
                                    self.folder / "hosts")
            self.nodes: tuple[str, ...] = names
            self.controller_host = self.netns.controller
            self.controller_addr = self.netns.address(-1)
            self.ports = (6817, 6818)  # each namespace has its ports to itself
        else:
            if nodes != 1:
                raise ValueError("several nodes need namespaces=True")
            host = socket.gethostname().split(".", 1)[0]
            self.nodes = (host,)
            self.controller_host = host
            self.controller_addr = "127.0.0.1"
            ctld_port, slurmd_port = free_ports(2)
            self.ports = (ctld_port, slurmd_port)
        self.conf = self.folder / "slurm.conf"
        # Job ids (and with them train.sbatch's sockets and ports) differ between runs.
        self.first_job_id = random.randrange(10_000, 900_000)

    # -- set-up ------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment of every process of this cluster, and of the jobs it runs."""
        return {**os.environ, "SLURM_CONF": str(self.conf), MARK: self.mark}

    def _write_config(self) -> None:
        munge_socket = self.folder / "munge.sock"
        if self.netns is None:
            nodes = [f"NodeName={self.nodes[0]} NodeAddr=127.0.0.1 CPUs={self.cpus}"]
        else:
            nodes = [f"NodeName={node} NodeAddr={self.netns.address(i)} CPUs={self.cpus}"
                     for i, node in enumerate(self.nodes)]
        self.conf.write_text("\n".join([
            "ClusterName=gradsynctest",
            f"SlurmctldHost={self.controller_host}({self.controller_addr})",
            f"SlurmctldPort={self.ports[0]}",
            f"SlurmdPort={self.ports[1]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={self.folder}/state",
            f"SlurmdSpoolDir={self.folder}/spool-%n",
            f"SlurmctldPidFile={self.folder}/slurmctld.pid",
            f"SlurmdPidFile={self.folder}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.folder}/slurmctld.log",
            f"SlurmdLogFile={self.folder}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # The CPUs below are what the jobs may use, whatever this machine has.
            "SlurmdParameters=config_overrides",
            f"FirstJobId={self.first_job_id}",
            # sbatch --wait polls every 2 s only while MinJobAge exceeds twice that
            # (else it backs off to 32 s between polls).
            "MinJobAge=5",
            "KillWait=5",
            "InactiveLimit=0",
            *nodes,
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _spawn(self, name: str, command: Sequence[str]) -> None:
        log = open(self.folder / f"{name}.out", "wb")  # noqa: SIM115 (closed with the process)
        with log:
            process = subprocess.Popen(
                list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )
        self.processes.append((name, process))

    def start(self) -> None:
        (self.folder / "state").mkdir()
        for node in self.nodes:
            (self.folder / f"spool-{node}").mkdir()
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._write_config()
        if self.netns is not None:
            self.netns.create()
        self._spawn("munged", [
            "munged", "--foreground", "--force", f"--socket={self.folder}/munge.sock",
            f"--key-file={key}", f"--pid-file={self.folder}/munged.pid",
            f"--log-file={self.folder}/munged.log", f"--seed-file={self.folder}/munged.seed",
        ])
        poll_until(lambda: (self.folder / "munge.sock").exists(), _START_TIMEOUT_S,
                   "munged's socket")
        ctld = ["slurmctld", "-D", "-i", "-f", str(self.conf)]
        if self.netns is not None:
            ctld = [*self.netns.enter(self.netns.controller, self.controller_host), *ctld]
        self._spawn("slurmctld", ctld)
        for index, node in enumerate(self.nodes):
            slurmd = ["slurmd", "-D", "-f", str(self.conf), "-N", node]
            if self.netns is not None:
                slurmd = [*self.netns.enter(self.netns.namespace(node), node), *slurmd]
            self._spawn(f"slurmd{index}", slurmd)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._all_idle():
            self._assert_running()
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm's nodes not idle within {_START_TIMEOUT_S}s:\n"
                                     + self.logs())
            time.sleep(0.2)

    def _all_idle(self) -> bool:
        done = self.command(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)

    def _assert_running(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise AssertionError(f"{name} exited with {process.returncode}:\n"
                                     + self.logs())

    # -- use ---------------------------------------------------------------------

    def command(self, argv: Sequence[str], check: bool = True, timeout_s: float = 60.0,
                cwd: str | None = None, env: Mapping[str, str] | None = None,
                ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command, run where it reaches slurmctld."""
        prefix = self.netns.enter(self.netns.controller) if self.netns is not None else []
        return subprocess.run([*prefix, *argv], capture_output=True, text=True,
                              env={**self.env, **(env or {})}, timeout=timeout_s, check=check,
                              cwd=cwd)

    def sbatch(self, script: str | Path, *args: str, options: Sequence[str] = (),
               cwd: str | None = None, env: Mapping[str, str] | None = None,
               timeout_s: float = 180.0) -> JobResult:
        """Submit `script` with `sbatch --wait` (the job gets sbatch's environment plus
        `env`); its output once it ended."""
        output = self.folder / "job-%j.out"
        done = self.command(["sbatch", "--wait", "--parsable", f"--output={output}",
                             *options, str(script), *args], check=False, timeout_s=timeout_s,
                            cwd=cwd, env=env)
        match = re.match(r"(\d+)", done.stdout.strip())
        if match is None:
            raise AssertionError(f"sbatch did not submit: {done.stdout}{done.stderr}\n"
                                 + self.logs())
        job_id = int(match.group(1))
        path = Path(str(output).replace("%j", str(job_id)))
        text = path.read_text(errors="replace") if path.exists() else "(no output file)"
        return JobResult(job_id, done.returncode, text, done.stderr)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.folder.glob("*.out")) + sorted(self.folder.glob("*.log")):
            if path.name.startswith("job-"):
                continue
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- tear-down ---------------------------------------------------------------

    def _marked_pids(self) -> list[int]:
        """Processes of this cluster: started here or by its daemons (job steps)."""
        needle = f"{MARK}={self.mark}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    pids.append(int(entry))
        return pids

    def stop(self) -> None:
        """Cancel what still runs, stop the daemons, kill stragglers, remove namespaces."""
        if any(process.poll() is None for name, process in self.processes
               if name == "slurmctld"):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.command(["scancel", "--full", "--quiet", "--user=root"], check=False,
                             timeout_s=20)
        for _name, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        # slurmstepd and the tasks it started do not die with slurmd: kill them by pid.
        for _attempt in range(50):
            pids = self._marked_pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        if self.netns is not None:
            self.netns.remove()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

