"""Daemon configuration: one frozen dataclass, filled from four sources.

Precedence, highest first: command-line flags, `GRADSYNC_*` environment
variables, a TOML file (`--config`), defaults.  An unknown TOML key or a bad
value from any source stops the start with a message naming the key and the
source.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from typing import Any

from gradsync.daemon.core.failure_detector import DETECTORS, DetectorKind
from gradsync.daemon.errors import ConfigError as ConfigError
from gradsync.protocol.endpoint import (
    default_endpoint,
    ipc_endpoint,
    parse_tcp_endpoint,
    stats_stream_endpoint,
)
from gradsync.protocol.peer import ALGORITHM_CHOICES

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}

#: Default codec lanes: the cores this daemon may run on, up to this many.
CODEC_LANES_DEFAULT_MAX = 4
#: ... and the most a setting may ask for.
CODEC_LANES_MAX = 64


def default_codec_lanes() -> int:
    """Threads that code compressed slices: the cores the daemon may use (its CPU
    affinity), at most CODEC_LANES_DEFAULT_MAX."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(CODEC_LANES_DEFAULT_MAX, cores))


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    """Everything a daemon needs to know at start (docs/running.md, "Settings")."""

    socket: str = dataclasses.field(default_factory=default_endpoint)
    threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    collective_timeout_s: float = 300.0
    max_shm_bytes: int = 8 * 1024**3
    inline_reduce_bytes: int = 4 * 1024**2
    #: Synchronous allreduces of single-node jobs up to this size take the shared-
    #: memory fast path (protocol/fast_path.py); 0 turns it off.
    fast_path_bytes: int = 64 * 1024
    #: Complete checkpoints kept per job in daemon memory (daemon/checkpoints.py).
    checkpoints_kept: int = 2
    #: Leave the complete checkpoints in /dev/shm at a clean exit too, for the next
    #: daemon on the same socket (a crashed daemon's are taken over either way).
    checkpoints_survive_exit: bool = False
    #: Peer daemons each checkpoint part is replicated to (daemon/io/checkpoint_peers.py);
    #: a daemon without peers keeps none.
    checkpoint_replicas: int = 1
    log_level: str = "info"
    #: Socket 0660 (folder 0750) and segments 0660: clients of the daemon's group
    #: may use it (the systemd unit runs it as user and group gradsync).
    group_access: bool = False
    #: Statistics endpoint (REP; the PUB stream is the same + ".pub").  Default:
    #: the client socket's path + ".stats".
    stats: str | None = None
    #: A collective waiting longer than this logs, once, what it waits for.
    stall_warn_s: float = 60.0
    #: Exit (cleanly, as on SIGTERM) once no client has been connected for this
    #: long; 0: never.  The torch backend's private daemons use it, so a daemon
    #: started for a job ends with the job's ranks on its node.
    exit_when_idle_s: float = 0.0
    #: The socket's folder is this daemon's alone (the torch backend made it for
    #: one job): remove the folder and all in it when the daemon exits.
    own_folder: bool = False
    # Peers (multi-node jobs).
    listen: str | None = None
    peers: tuple[str, ...] = ()
    peers_file: str | None = None
    #: Peers are the nodes of the Slurm allocation (`SLURM_JOB_NODELIST`), each at
    #: `port`; `listen` defaults to this node's name at `port` (daemon/slurm.py).
    peers_from_slurm: bool = False
    port: int = 29400
    curve_secret: str | None = None
    curve_authorized: str | None = None
    insecure: bool = False
    #: The TCP port the data streams listen on, on `listen`'s host (0: any free port).
    data_port: int = 0
    #: `HOST:PORT` that peers open their data streams to, when that is not
    #: `listen`'s host and `data_port` (a NAT or port forward in between).
    data_advertise: str | None = None
    #: The failure detector's upper bound: a peer silent this long is lost whatever
    #: else (it declares a vanished one in about 2 s: daemon/core/failure_detector.py).
    peer_timeout_s: float = 10.0
    #: `adaptive` (suspicion, witnesses, local health), or `timeout`: a silent peer is
    #: declared at `peer_timeout_s` alone, with heartbeats once a second.
    failure_detector: DetectorKind = "adaptive"
    #: Ring neighbours heartbeated on either side when no job uses a peer
    #: (daemon/core/watching.py); 0: log2 of the daemons.
    watch_neighbours: int = 0
    #: A link opened on first use (past a few daemons: daemon/peers/links.py) is
    #: closed after this long with nothing sent or heard, unless a job uses it.
    link_idle_s: float = 60.0
    #: 4 MiB rather than 1 or 2: each slice costs the daemon's Python about 80
    #: calls at either end, and 4 MiB slices measured 6 to 20 % faster than
    #: 2 MiB ones where the CPUs bind, the same where the wire does
    #: (benchmarks/RESULTS.md, interdaemon notes).
    pipeline_slice_bytes: int = 4 * 1024**2
    algorithm: str = "auto"
    #: `auto` times every algorithm its model prices within this factor of the
    #: best before it settles by timings (1: the model alone decides).
    auto_explore_factor: float = 1.5
    #: Threads that encode and decode compressed slices (docs/compression.md);
    #: results are the same bits whatever the number.
    codec_lanes: int = dataclasses.field(default_factory=default_codec_lanes)

    def all_peers(self) -> tuple[str, ...]:
        """`peers` plus the endpoints listed in `peers_file`, in order, without repeats."""
        endpoints = list(self.peers)
        if self.peers_file:
            # Imported here: the peers package pulls in ZeroMQ, which reading the
            # configuration does not need.
            from gradsync.daemon.peers.endpoints import read_peers_file

            try:
                endpoints += read_peers_file(self.peers_file)
            except ValueError as exc:
                raise ConfigError(f"bad peers_file: {exc}") from None
        return tuple(dict.fromkeys(endpoints))


def parse_size(text: str) -> int:
    """Bytes from `1048576`, `64MiB`, `8G` (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 1073741824, 512MiB, 8GiB)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "")[:1].lower()])


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer, got {value!r}")
    try:
        number = int(value.strip()) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"must be positive, got {number}")
    return number


def _count(value: Any) -> int:
    """A non-negative integer."""
    if isinstance(value, str) and value.strip() == "0":
        return 0
    if not isinstance(value, bool) and value == 0:
        return 0
    return _positive_int(value)


def _positive_size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a size")
    number = parse_size(value) if isinstance(value, str) else int(value)
    if number != value and not isinstance(value, str):
        raise ValueError(f"expected an integer number of bytes, got {value!r}")
    if number <= 0:
        raise ValueError(f"must be positive, got {number}")
    return number


def _size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a size")
    if value == 0 or (isinstance(value, str) and value.strip() == "0"):
        return 0
    return _positive_size(value)


#: The fast path's page holds two buffers of this size per rank, hence a cap.
_FAST_PATH_MAX = 16 * 1024**2


def _fast_path_size(value: Any) -> int:
    number = _size(value)
    if number > _FAST_PATH_MAX:
        raise ValueError(f"at most {_FAST_PATH_MAX} bytes (16MiB), got {number}")
    return number


def _positive_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number")
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise ValueError(f"must be a positive finite number, got {value!r}")
    return number


def _seconds_or_zero(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number of seconds")
    number = float(value)
    if number == 0:
        return 0.0
    return _positive_float(number)


def _log_level(value: Any) -> str:
    level = str(value).lower()
    if level not in _LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(_LOG_LEVELS)}, got {value!r}")
    return level


def _endpoint(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected an endpoint string like ipc:///run/gradsync/gradsyncd.sock")
    # A bare path is taken as ipc://PATH: the endpoints derived from it (PATH.stats)
    # must carry the scheme too.
    return ipc_endpoint(value)


def _stats_endpoint(value: Any) -> str:
    if isinstance(value, str) and value.startswith("tcp://"):
        stats_stream_endpoint(_tcp_endpoint(value))  # the stream takes the next port
        return value
    return _endpoint(value)


def _tcp_endpoint(value: Any) -> str:
    try:
        parse_tcp_endpoint(value)
    except ValueError as exc:
        raise ValueError(f"expected tcp://HOST:PORT: {exc}") from None
    return str(value)


def _endpoint_list(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError("expected a list of tcp://HOST:PORT endpoints")
    return tuple(_tcp_endpoint(item.strip() if isinstance(item, str) else item)
                 for item in items if not (isinstance(item, str) and not item.strip()))


def _port(value: Any) -> int:
    number = _positive_int(value)
    if number > 65535:
        raise ValueError(f"a TCP port is at most 65535, got {number}")
    return number


def _any_port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a TCP port, got {value!r}")
    if value == 0 or (isinstance(value, str) and value.strip() == "0"):
        return 0
    return _port(value)


def _host_port(value: Any) -> str:
    """`HOST:PORT` (IPv6 hosts in brackets) that peers can reach: no wildcard host."""
    if not isinstance(value, str) or value.startswith("tcp://"):
        raise ValueError(f"expected HOST:PORT (e.g. gw.example.org:29500), got {value!r}")
    try:
        endpoint = parse_tcp_endpoint("tcp://" + value)
    except ValueError:
        raise ValueError(
            f"expected HOST:PORT (IPv6 as [ADDR]:PORT, port 1-65535), got {value!r}") from None
    if endpoint.is_wildcard:
        raise ValueError(f"{endpoint.host!r} is no address a peer can reach")
    if len(endpoint.host.encode()) > 255:
        raise ValueError("the host is longer than 255 bytes")
    return value


def _optional_path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a file or folder path")
    return value


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _factor(value: Any) -> float:
    number = _positive_float(value)
    if number < 1:
        raise ValueError(f"must be at least 1, got {value!r}")
    return number


def _codec_lanes(value: Any) -> int:
    number = _positive_int(value)
    if number > CODEC_LANES_MAX:
        raise ValueError(f"at most {CODEC_LANES_MAX}, got {number}")
    return number


def _count_or_zero(value: Any) -> int:
    return 0 if value in (0, "0") else _positive_int(value)


def _failure_detector(value: Any) -> DetectorKind:
    name = str(value).lower()
    if name not in DETECTORS:
        raise ValueError(f"must be one of {', '.join(DETECTORS)}, got {value!r}")
    return name


def _algorithm(value: Any) -> str:
    name = str(value).lower()
    if name not in ALGORITHM_CHOICES:
        raise ValueError(f"must be one of {', '.join(ALGORITHM_CHOICES)}, got {value!r}")
    return name


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "socket": _endpoint,
    "threads": _positive_int,
    "collective_timeout_s": _positive_float,
    "max_shm_bytes": _positive_size,
    "inline_reduce_bytes": _positive_size,
    "fast_path_bytes": _fast_path_size,
    "checkpoints_kept": _positive_int,
    "checkpoints_survive_exit": _boolean,
    "checkpoint_replicas": _count,
    "log_level": _log_level,
    "group_access": _boolean,
    "stats": _stats_endpoint,
    "stall_warn_s": _positive_float,
    "exit_when_idle_s": _seconds_or_zero,
    "own_folder": _boolean,
    "listen": _tcp_endpoint,
    "peers": _endpoint_list,
    "peers_file": _optional_path,
    "peers_from_slurm": _boolean,
    "port": _port,
    "curve_secret": _optional_path,
    "curve_authorized": _optional_path,
    "insecure": _boolean,
    "data_port": _any_port,
    "data_advertise": _host_port,
    "peer_timeout_s": _positive_float,
    "failure_detector": _failure_detector,
    "watch_neighbours": _count_or_zero,
    "link_idle_s": _positive_float,
    "pipeline_slice_bytes": _positive_size,
    "algorithm": _algorithm,
    "auto_explore_factor": _factor,
    "codec_lanes": _codec_lanes,
}

#: Short aliases read from the environment besides GRADSYNC_<KEY>.
_ENV_ALIASES = {"algorithm": "GRADSYNC_ALGO", "socket": "GRADSYNC_DAEMON"}


def env_name(key: str) -> str:
    """The environment variable for a config key: `GRADSYNC_<KEY>`."""
    return "GRADSYNC_" + key.upper()


def _apply(values: dict[str, Any], source: Mapping[str, Any], origin: str) -> None:
    for key, raw in source.items():
        parser = _PARSERS.get(key)
        if parser is None:
            known = ", ".join(_PARSERS)
            raise ConfigError(f"unknown setting {key!r} in {origin}; known settings: {known}")
        try:
            values[key] = parser(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"bad value for {key!r} in {origin}: {exc}") from None


def load_config(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    toml_path: str | None = None,
) -> DaemonConfig:
    """Merge the sources (flags > environment > TOML > defaults) and validate."""
    values: dict[str, Any] = {}
    if toml_path is not None:
        try:
            with open(toml_path, "rb") as handle:
                table = tomllib.load(handle)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {toml_path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {toml_path} is not valid TOML: {exc}") from None
        _apply(values, table, f"config file {toml_path}")
    environ = os.environ if environ is None else environ
    for key in _PARSERS:
        for name in (_ENV_ALIASES.get(key), env_name(key)):
            if name and name in environ:
                _apply(values, {key: environ[name]}, f"environment variable {name}")
    if flags:
        _apply(values, {k: v for k, v in flags.items() if v is not None}, "command-line flags")
    return DaemonConfig(**values)
