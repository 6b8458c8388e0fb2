"""Where a client's identity comes from when the caller does not say.

Sources, highest first, decided once for the whole identity:

1. explicit arguments (`Client(rank=..., world_size=..., ...)`), field by field;
2. torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`),
   which `gradsync launch` sets too;
3. Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, and the tasks of
   this node from `SLURM_NTASKS_PER_NODE` such as `4`, `2(x3)` or `3,2(x2)`,
   indexed by `SLURM_NODEID`), as `srun` sets them: only in a job step
   (`SLURM_STEP_ID`, or the older `SLURM_STEPID`, is set).  A batch script's
   own processes see `SLURM_PROCID=0` and `SLURM_NTASKS=N` too, but a plain
   `python train.py` there is one process, not N tasks; like torch, which
   reads no Slurm variables, it runs as a job of one, and `Identity.note`
   says why (`Client()` warns with it);
4. Open MPI's (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
   `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`), as `mpirun` sets them;
5. none of them: a job of one.

The first launcher style whose rank variable is present supplies every field
the caller left unset; styles are never mixed.  gradsync's own variables
(`GRADSYNC_DAEMON`, `GRADSYNC_JOB`, `GRADSYNC_TIMEOUT_S`) apply to all styles.
Without `GRADSYNC_JOB`, a Slurm step is named `slurm-JOBID.STEPID` and an
Open MPI job `ompi-NAMESPACE`, the same on every node of the job.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping

from gradsync.protocol.endpoint import default_endpoint
from gradsync.protocol.errors import InvalidArgumentError

#: Launcher styles, in precedence order, as `Identity.source` names them.
SOURCES = ("explicit", "torchrun", "slurm", "openmpi", "single")


@dataclasses.dataclass(frozen=True)
class Identity:
    daemon: str
    job: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    timeout_s: float | None
    #: Which launcher's variables supplied the rank (one of `SOURCES`).
    source: str = "single"
    #: Why the environment was not taken at its word, for the user to read (or None).
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class _Launcher:
    """What one launcher style says about this process (None: not said)."""

    source: str
    rank: int | None
    world_size: int | None
    local_rank: int | None
    local_world_size: int | None
    job: str | None


def _int_from_env(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"environment variable {name}={raw!r} is not an integer"
        ) from None


_TASKS_ITEM = re.compile(r"^\s*(\d+)\s*(?:\(\s*x\s*(\d+)\s*\))?\s*$")


def parse_slurm_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's compressed per-node task counts: `3,2(x2)` -> [3, 2, 2]."""
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_ITEM.match(item)
        if match is None:
            raise InvalidArgumentError(
                f"cannot read Slurm tasks per node {value!r}: expected items like "
                "'4' or '2(x3)', separated by commas"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _slurm_local_world_size(env: Mapping[str, str], world_size: int | None) -> int | None:
    """This node's task count, from the first per-node list Slurm gave."""
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = env.get(name)
        if not raw:
            continue
        counts = parse_slurm_tasks_per_node(raw)
        if len(counts) == 1:
            # One number: the same count on every node (what --ntasks-per-node gives).
            return counts[0]
        node = _int_from_env(env, "SLURM_NODEID")
        if node is None:
            raise InvalidArgumentError(
                f"{name}={raw!r} differs between nodes, but SLURM_NODEID is not set to say "
                "which node this is"
            )
        if not 0 <= node < len(counts):
            raise InvalidArgumentError(
                f"SLURM_NODEID={node} is outside the {len(counts)} nodes of {name}={raw!r}"
            )
        return counts[node]
    if _int_from_env(env, "SLURM_NNODES") == 1 or _int_from_env(env, "SLURM_JOB_NUM_NODES") == 1:
        return world_size
    return None


def _torchrun(env: Mapping[str, str]) -> _Launcher | None:
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    return _Launcher(
        "torchrun", _int_from_env(env, "RANK"), _int_from_env(env, "WORLD_SIZE"),
        _int_from_env(env, "LOCAL_RANK"), _int_from_env(env, "LOCAL_WORLD_SIZE"), None,
    )


def _slurm_step(env: Mapping[str, str]) -> str | None:
    """The job step this process is a task of; None outside any (a batch script)."""
    return env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or None


def _slurm(env: Mapping[str, str]) -> _Launcher | None:
    if "SLURM_PROCID" not in env or _slurm_step(env) is None:
        return None
    world_size = _int_from_env(env, "SLURM_NTASKS")
    if world_size is None:
        world_size = _int_from_env(env, "SLURM_NPROCS")  # the older name
    job = None
    if env.get("SLURM_JOB_ID"):
        job = f"slurm-{env['SLURM_JOB_ID']}.{_slurm_step(env)}"
    return _Launcher(
        "slurm", _int_from_env(env, "SLURM_PROCID"), world_size,
        _int_from_env(env, "SLURM_LOCALID"), _slurm_local_world_size(env, world_size), job,
    )


def _openmpi(env: Mapping[str, str]) -> _Launcher | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    namespace = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid")
    return _Launcher(
        "openmpi", _int_from_env(env, "OMPI_COMM_WORLD_RANK"),
        _int_from_env(env, "OMPI_COMM_WORLD_SIZE"),
        _int_from_env(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        _int_from_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        f"ompi-{namespace}" if namespace else None,
    )


_VARIABLES = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
}


def _batch_script_note(env: Mapping[str, str]) -> str | None:
    """What to tell a process of a batch script that Slurm allotted several tasks."""
    if "SLURM_PROCID" not in env or _slurm_step(env) is not None:
        return None
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or ""
    if not tasks.isdigit() or int(tasks) <= 1:
        return None  # a job of one is what the allocation asked for: nothing to say
    return (
        f"SLURM_NTASKS={tasks} is set but SLURM_STEP_ID is not: this process runs in "
        f"the batch script itself, not as one of {tasks} tasks of an srun step, so it "
        f"runs as a job of one; start the ranks with `srun python ...` to run {tasks}"
    )


def detect_launcher(environ: Mapping[str, str]) -> _Launcher | None:
    """The first launcher style (torchrun, Slurm, Open MPI) present in `environ`."""
    for style in (_torchrun, _slurm, _openmpi):
        found = style(environ)
        if found is not None:
            return found
    return None


def resolve_identity(
    daemon: str | None = None,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> Identity:
    """Fill every unset argument from the environment, then check consistency."""
    env = os.environ if environ is None else environ
    launcher = detect_launcher(env)
    source = "explicit" if rank is not None and world_size is not None else "single"
    if launcher is not None:
        if source != "explicit":
            source = launcher.source
        rank = rank if rank is not None else launcher.rank
        world_size = world_size if world_size is not None else launcher.world_size
        local_rank = local_rank if local_rank is not None else launcher.local_rank
        if local_world_size is None:
            local_world_size = launcher.local_world_size
        job = job or env.get("GRADSYNC_JOB") or launcher.job
    if (rank is None) != (world_size is None):
        names = _VARIABLES.get(launcher.source if launcher else "torchrun", ("RANK", "WORLD_SIZE"))
        raise InvalidArgumentError(
            f"set both rank and world_size (or {names[0]} and {names[1]}), or neither for a "
            f"single-process job; got rank={rank}, world_size={world_size}"
        )
    if rank is None or world_size is None:
        rank, world_size = 0, 1
    if local_rank is None:
        local_rank = rank
    if local_world_size is None:
        if launcher is not None and launcher.source == "slurm" and world_size > 1:
            raise InvalidArgumentError(
                "Slurm did not say how many tasks run on this node: set SLURM_NTASKS_PER_NODE "
                "(srun --ntasks-per-node) or LOCAL_WORLD_SIZE"
            )
        local_world_size = world_size
    if timeout_s is None and env.get("GRADSYNC_TIMEOUT_S"):
        try:
            timeout_s = float(env["GRADSYNC_TIMEOUT_S"])
        except ValueError:
            raise InvalidArgumentError(
                f"GRADSYNC_TIMEOUT_S={env['GRADSYNC_TIMEOUT_S']!r} is not a number"
            ) from None
    if timeout_s is not None and not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise InvalidArgumentError(f"timeout_s must be positive and finite, got {timeout_s}")
    where = f" (from {source} variables)" if source in _VARIABLES else ""
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} is outside world_size {world_size}{where}")
    if not 0 <= local_rank < local_world_size <= world_size:
        raise InvalidArgumentError(
            f"need 0 <= local_rank < local_world_size <= world_size, got "
            f"{local_rank}, {local_world_size}, {world_size}{where}"
        )
    note = _batch_script_note(env) if source == "single" else None
    return Identity(
        daemon=daemon or env.get("GRADSYNC_DAEMON") or default_endpoint(),
        job=job or env.get("GRADSYNC_JOB") or "default",
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        timeout_s=timeout_s,
        source=source,
        note=note,
    )
