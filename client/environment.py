"""Where a client's identity comes from when the caller does not say.

torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`)
and gradsync's own (`GRADSYNC_DAEMON`, `GRADSYNC_JOB`, `GRADSYNC_TIMEOUT_S`).
A process with none of them set is a job of one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from gradsync.protocol.endpoint import default_endpoint
from gradsync.protocol.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Identity:
    daemon: str
    job: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    timeout_s: float | None


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
    rank = rank if rank is not None else _int_from_env(env, "RANK")
    world_size = world_size if world_size is not None else _int_from_env(env, "WORLD_SIZE")
    if (rank is None) != (world_size is None):
        raise InvalidArgumentError(
            "set both rank and world_size (or RANK and WORLD_SIZE), or neither for a "
            f"single-process job; got rank={rank}, world_size={world_size}"
        )
    if rank is None or world_size is None:
        rank, world_size = 0, 1
    local_rank = local_rank if local_rank is not None else _int_from_env(env, "LOCAL_RANK")
    local_world_size = (
        local_world_size
        if local_world_size is not None
        else _int_from_env(env, "LOCAL_WORLD_SIZE")
    )
    if local_rank is None:
        local_rank = rank
    if local_world_size is None:
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
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} is outside world_size {world_size}")
    if not 0 <= local_rank < local_world_size <= world_size:
        raise InvalidArgumentError(
            f"need 0 <= local_rank < local_world_size <= world_size, got "
            f"{local_rank}, {local_world_size}, {world_size}"
        )
    return Identity(
        daemon=daemon or env.get("GRADSYNC_DAEMON") or default_endpoint(),
        job=job or env.get("GRADSYNC_JOB") or "default",
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        timeout_s=timeout_s,
    )
