"""Peers from a Slurm allocation: every node of the job runs one daemon at one port.

`gradsyncd --peers-from-slurm --port P` started as a task of a job step (one
per node) reads `SLURM_JOB_NODELIST` (`node[01-03,07],gpu-a`), has Slurm's own
`scontrol show hostnames` expand it (the compressed syntax has corners, such as
zero padding and several bracket groups, that only Slurm defines), and peers
with `tcp://NODE:P` for each node.  Unless `--listen` is given, this daemon
listens at its own node's name (`SLURMD_NODENAME`, which slurmd sets in every
task, else the host name) at P: the same string its peers dial, so each daemon
recognises itself in the shared list without resolving names.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping

from gradsync.daemon.config import ConfigError, DaemonConfig
from gradsync.daemon.peers.endpoints import parse_tcp_endpoint

#: `scontrol show hostnames` answers from the string alone; a hung one is still refused.
_SCONTROL_TIMEOUT_S = 30.0


def job_nodelist(environ: Mapping[str, str]) -> str:
    """The allocation's compressed node list; `ConfigError` outside an allocation."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError(
            "--peers-from-slurm: SLURM_JOB_NODELIST is not set; start gradsyncd inside a "
            "Slurm allocation (srun --ntasks-per-node=1 ... gradsyncd --peers-from-slurm), "
            "or give --peers"
        )
    return nodelist


def expand_hostnames(nodelist: str, environ: Mapping[str, str]) -> list[str]:
    """Node names of `nodelist` in Slurm's order, through `scontrol show hostnames`."""
    scontrol = shutil.which("scontrol", path=environ.get("PATH", os.defpath))
    if scontrol is None:
        raise ConfigError(
            f"--peers-from-slurm: Slurm's scontrol is not on PATH, and it is what expands "
            f"SLURM_JOB_NODELIST={nodelist!r} into node names; run gradsyncd where Slurm's "
            f"commands are installed, or give the peers with --peers or --peers-file"
        )
    try:
        done = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
            timeout=_SCONTROL_TIMEOUT_S, env=dict(environ), stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(
            f"--peers-from-slurm: `{scontrol} show hostnames {nodelist}` failed: {exc}"
        ) from None
    names = done.stdout.split()
    if done.returncode != 0 or not names:
        said = done.stderr.strip() or f"no node names, exit status {done.returncode}"
        raise ConfigError(
            f"--peers-from-slurm: `{scontrol} show hostnames {nodelist}` failed: {said}"
        )
    return list(dict.fromkeys(names))


def this_node(environ: Mapping[str, str], nodes: list[str]) -> str:
    """This node's name as the node list spells it."""
    name = environ.get("SLURMD_NODENAME")
    if name:
        return name
    for candidate in (socket.gethostname(), socket.gethostname().split(".", 1)[0]):
        if candidate in nodes:
            return candidate
    raise ConfigError(
        f"--peers-from-slurm: cannot tell which node of {', '.join(nodes)} this is: "
        f"SLURMD_NODENAME is not set (gradsyncd is not a task of a job step) and the host "
        f"name {socket.gethostname()!r} is not in the list; start it with srun, or give "
        f"--listen tcp://HOST:PORT"
    )


def with_slurm_peers(config: DaemonConfig, environ: Mapping[str, str] | None = None) -> (
        DaemonConfig):
    """`config` with the allocation's daemons as peers and, unless set, `listen`.

    Peers given otherwise (`--peers`, `--peers-file`) are kept, in front.
    """
    if not config.peers_from_slurm:
        return config
    env = os.environ if environ is None else environ
    nodes = expand_hostnames(job_nodelist(env), env)
    peers = tuple(f"tcp://{node}:{config.port}" for node in nodes)
    for peer in peers:
        try:
            parse_tcp_endpoint(peer)
        except ValueError as exc:
            raise ConfigError(f"--peers-from-slurm: node list {nodes}: {exc}") from None
    listen = config.listen or f"tcp://{this_node(env, nodes)}:{config.port}"
    return dataclasses.replace(
        config, peers=tuple(dict.fromkeys(config.peers + peers)), listen=listen
    )
