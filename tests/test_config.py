"""Daemon configuration: precedence of the four sources, validation, and the CLI's exit.

`load_config` is exercised directly (flags > environment > TOML > defaults;
unknown keys and bad values rejected naming key and source), then end to end:
`gradsyncd` with a bad file or variable exits 2 naming the key, and a running
daemon reports the timeout that won.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import DaemonProcess, wait_until_ready
from gradsync.client.cli.stats import fetch_snapshot
from gradsync.client.ping import query
from gradsync.daemon.config import (
    ConfigError,
    DaemonConfig,
    env_name,
    load_config,
    parse_size,
)

StartDaemon = Callable[..., DaemonProcess]
GRADSYNCD = os.path.join(os.path.dirname(sys.executable), "gradsyncd")
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}


def write_toml(folder: Path, text: str, name: str = "gradsyncd.toml") -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


# -- precedence --------------------------------------------------------------


def test_defaults() -> None:
    config = load_config(flags={}, environ={})
    assert config == DaemonConfig()
    assert config.collective_timeout_s == 300.0
    assert config.max_shm_bytes == 8 * 1024**3
    assert config.threads == (os.cpu_count() or 1)
    assert config.log_level == "info"
    assert config.socket.startswith("ipc:///") and config.socket.endswith("/gradsyncd.sock")


def test_the_docs_settings_tables_name_every_setting_its_flag_and_default() -> None:
    """Docs that match: each setting once, with its flag and, where the code has
    a fixed default, that value (none is said in words)."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    readme = "\n".join(page.read_text() for page in sorted(docs.glob("*.md")))
    rows = re.findall(r"^\| `([a-z_]+)` \| `(--[a-z-]+)` \| (.+?) \| ", readme, re.MULTILINE)
    documented = {name: (flag, default) for name, flag, default in rows}
    assert len(documented) == len(rows), "a setting is documented twice"
    fields = dataclasses.fields(DaemonConfig)
    assert set(documented) == {field.name for field in fields}
    for field in fields:
        flag, default = documented[field.name]
        assert flag == "--" + field.name.replace("_", "-")
        literal = re.fullmatch(r"`([^`]*)`", default)
        if field.default is dataclasses.MISSING:
            continue  # computed at start (the socket path, the core count)
        if field.default in (None, ()):
            assert literal is None, f"{field.name}: the docs give {default}, the code none"
            continue
        assert literal is not None, f"{field.name}: the docs give {default!r}, not a value"
        text = literal.group(1)
        if isinstance(field.default, bool):
            assert text == str(field.default).lower(), field.name
        elif field.name.endswith("_bytes"):
            assert parse_size(text) == field.default, field.name
        else:
            assert type(field.default)(text) == field.default, field.name


def test_flags_beat_environment_beat_toml_beat_defaults(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, """
socket = "ipc:///tmp/from-toml/gradsyncd.sock"
threads = 3
collective_timeout_s = 10.0
max_shm_bytes = "64MiB"
log_level = "debug"
""")
    environ = {
        "GRADSYNC_THREADS": "5",
        "GRADSYNC_COLLECTIVE_TIMEOUT_S": "20.5",
        "GRADSYNC_JOB": "not-a-daemon-setting",  # a client variable: ignored, not an error
    }
    flags: dict[str, Any] = {"threads": "7", "collective_timeout_s": None, "log_level": None}
    config = load_config(flags=flags, environ=environ, toml_path=toml)
    assert config.threads == 7  # flag over environment over TOML
    assert config.collective_timeout_s == 20.5  # environment over TOML (flag left unset)
    assert config.max_shm_bytes == 64 * 1024**2  # TOML over default
    assert config.log_level == "debug"
    assert config.socket == "ipc:///tmp/from-toml/gradsyncd.sock"
    assert config.inline_reduce_bytes == DaemonConfig().inline_reduce_bytes  # default
    assert load_config(flags={}, environ=environ, toml_path=toml).threads == 5
    assert config.fast_path_bytes == 64 * 1024  # default
    assert load_config(flags={"fast_path_bytes": "0"}, environ={}).fast_path_bytes == 0
    assert load_config(flags={"fast_path_bytes": "4KiB"}, environ={}).fast_path_bytes == 4096
    assert load_config(flags={}, environ={}, toml_path=toml).threads == 3


def test_process_environment_is_read_when_none_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(env_name("max_shm_bytes"), "2GiB")
    monkeypatch.setenv("GRADSYNC_LOG_LEVEL", "WARNING")
    config = load_config()
    assert config.max_shm_bytes == 2 * 1024**3
    assert config.log_level == "warning"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1048576", 1048576), ("1MiB", 1048576), ("1M", 1048576), ("64 KiB", 65536),
     ("8G", 8 * 1024**3), ("1.5KiB", 1536), ("2t", 2 * 1024**4)],
)
def test_sizes_accept_binary_units(text: str, expected: int) -> None:
    assert load_config(flags={"max_shm_bytes": text}, environ={}).max_shm_bytes == expected


def test_the_data_streams_port_and_advertised_address() -> None:
    """Fixed port and advertised HOST:PORT from any source; IPv6 in brackets."""
    environ = {"GRADSYNC_DATA_ADVERTISE": "[fd00::7]:29501", "GRADSYNC_DATA_PORT": "29401"}
    config = load_config(flags={}, environ=environ)
    assert (config.data_port, config.data_advertise) == (29401, "[fd00::7]:29501")
    config = load_config(flags={"data_port": "0", "data_advertise": "gw.example.org:80"},
                         environ=environ)
    assert (config.data_port, config.data_advertise) == (0, "gw.example.org:80")


def test_the_quiet_time_before_a_link_closes() -> None:
    """`link_idle_s` (--link-idle-s, GRADSYNC_LINK_IDLE_S): seconds, positive."""
    assert load_config(flags={}, environ={}).link_idle_s == 60.0
    assert load_config(flags={}, environ={"GRADSYNC_LINK_IDLE_S": "2.5"}).link_idle_s == 2.5
    with pytest.raises(ConfigError, match="link_idle_s"):
        load_config(flags={"link_idle_s": "0"}, environ={})


def test_data_stream_settings_need_peer_links() -> None:
    from gradsync.daemon.io.peering import wants_peers

    for flags in ({"data_port": "29401"}, {"data_advertise": "gw.example.org:29501"}):
        with pytest.raises(ConfigError, match="data_advertise"):
            wants_peers(load_config(flags=flags, environ={}))


def test_codec_lanes_default_to_the_cores_the_daemon_may_use_at_most_4() -> None:
    """os.sched_getaffinity, not the machine's count: a daemon pinned to two cores
    codes on two threads; any count from 1 to 64 may be set."""
    cores = len(os.sched_getaffinity(0))
    assert load_config(flags={}, environ={}).codec_lanes == min(4, cores)
    assert load_config(flags={"codec_lanes": "3"}, environ={}).codec_lanes == 3
    assert load_config(flags={}, environ={"GRADSYNC_CODEC_LANES": "64"}).codec_lanes == 64
    with pytest.raises(ConfigError, match=r"'codec_lanes'.*at most 64"):
        load_config(flags={"codec_lanes": "100"}, environ={})


def test_config_is_frozen() -> None:
    config = load_config(flags={}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.threads = 1  # type: ignore[misc]


# -- validation --------------------------------------------------------------

BAD_TOML = [
    ("threads = 0", "threads"),
    ("threads = -2", "threads"),
    ("threads = 2.5", "threads"),
    ("threads = true", "threads"),
    ('threads = "many"', "threads"),
    ("collective_timeout_s = 0", "collective_timeout_s"),
    ("collective_timeout_s = -1.0", "collective_timeout_s"),
    ("collective_timeout_s = inf", "collective_timeout_s"),
    ("collective_timeout_s = nan", "collective_timeout_s"),
    ('collective_timeout_s = "soon"', "collective_timeout_s"),
    ("collective_timeout_s = false", "collective_timeout_s"),
    ('max_shm_bytes = "lots"', "max_shm_bytes"),
    ("max_shm_bytes = 0", "max_shm_bytes"),
    ('max_shm_bytes = "-1GiB"', "max_shm_bytes"),
    ("inline_reduce_bytes = -1", "inline_reduce_bytes"),
    ("fast_path_bytes = -1", "fast_path_bytes"),
    ('fast_path_bytes = "1GiB"', "fast_path_bytes"),
    ("fast_path_bytes = true", "fast_path_bytes"),
    ('log_level = "loud"', "log_level"),
    ('socket = "relative/gradsyncd.sock"', "socket"),
    ("socket = 5", "socket"),
    (f'socket = "ipc:///tmp/{"x" * 120}.sock"', "socket"),
    ("auto_explore_factor = 0.9", "auto_explore_factor"),
    ("data_port = 70000", "data_port"),
    ("data_port = -1", "data_port"),
    ('data_advertise = "gw.example.org"', "data_advertise"),
    ('data_advertise = "tcp://gw.example.org:29501"', "data_advertise"),
    ('data_advertise = "0.0.0.0:29501"', "data_advertise"),
    ('data_advertise = "::1:29501"', "data_advertise"),
    ('auto_explore_factor = "wide"', "auto_explore_factor"),
    ("codec_lanes = 0", "codec_lanes"),
    ("codec_lanes = 65", "codec_lanes"),
    ("codec_lanes = 1.5", "codec_lanes"),
    ("colective_timeout_s = 5", "colective_timeout_s"),
    ("[daemon]\nthreads = 2", "daemon"),
]


@pytest.mark.parametrize(("text", "key"), BAD_TOML)
def test_bad_toml_value_names_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    toml = write_toml(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as caught:
        load_config(flags={}, environ={}, toml_path=toml)
    message = str(caught.value)
    assert repr(key) in message and toml in message, message


def test_unknown_toml_key_lists_the_known_ones(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, "bogus = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'bogus'") as caught:
        load_config(flags={}, environ={}, toml_path=toml)
    assert "collective_timeout_s" in str(caught.value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("GRADSYNC_THREADS", "zero"), ("GRADSYNC_THREADS", "0"),
     ("GRADSYNC_COLLECTIVE_TIMEOUT_S", "-1"), ("GRADSYNC_COLLECTIVE_TIMEOUT_S", "inf"),
     ("GRADSYNC_MAX_SHM_BYTES", "lots"), ("GRADSYNC_MAX_SHM_BYTES", ""),
     ("GRADSYNC_LOG_LEVEL", "loud"), ("GRADSYNC_SOCKET", "gradsyncd.sock"),
     ("GRADSYNC_AUTO_EXPLORE_FACTOR", "0")],
)
def test_bad_environment_value_names_key_and_variable(variable: str, value: str) -> None:
    key = variable[len("GRADSYNC_") :].lower()
    with pytest.raises(ConfigError) as caught:
        load_config(flags={}, environ={variable: value})
    message = str(caught.value)
    assert repr(key) in message and variable in message, message


@pytest.mark.parametrize("value", ["1.5", "2k"])
def test_thread_count_must_be_a_plain_integer(value: str) -> None:
    with pytest.raises(ConfigError, match="threads"):
        load_config(flags={}, environ={"GRADSYNC_THREADS": value})


def test_bad_flag_value_names_key_and_flags() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(flags={"collective_timeout_s": "-3"}, environ={})
    assert "'collective_timeout_s'" in str(caught.value)
    assert "command-line" in str(caught.value)


def test_unreadable_or_invalid_toml_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="cannot read config file") as caught:
        load_config(flags={}, environ={}, toml_path=missing)
    assert missing in str(caught.value)
    broken = write_toml(tmp_path, "threads = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML") as caught:
        load_config(flags={}, environ={}, toml_path=broken)
    assert broken in str(caught.value)


def test_a_bad_lower_source_fails_even_if_a_higher_one_overrides_it(tmp_path: Path) -> None:
    """Every source is validated: a typo in the file is reported, not masked by a flag."""
    toml = write_toml(tmp_path, "threads = 0\n")
    with pytest.raises(ConfigError, match="threads"):
        load_config(flags={"threads": "2"}, environ={}, toml_path=toml)


# -- end to end --------------------------------------------------------------


def run_gradsyncd(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRADSYNCD, *args], capture_output=True, text=True, timeout=30,
        env={**CLEAN_ENV, **(env or {})}, stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("text", "key"),
    [("collective_timeout_s = -1\n", "collective_timeout_s"),
     ("colective_timeout_s = 5\n", "colective_timeout_s"),
     ('max_shm_bytes = "lots"\n', "max_shm_bytes")],
)
def test_gradsyncd_with_bad_config_file_exits_2_naming_the_key(
    short_tmp: str, text: str, key: str
) -> None:
    toml = write_toml(Path(short_tmp), text, "bad.toml")
    socket_path = f"{short_tmp}/never.sock"
    result = run_gradsyncd("--config", toml, "--socket", f"ipc://{socket_path}")
    assert result.returncode == 2, result
    assert key in result.stderr and "bad.toml" in result.stderr, result.stderr
    assert not os.path.exists(socket_path)


@pytest.mark.timeout(60)
def test_gradsyncd_with_bad_environment_exits_2_naming_the_key(short_tmp: str) -> None:
    socket_path = f"{short_tmp}/never.sock"
    result = run_gradsyncd(
        "--socket", f"ipc://{socket_path}", env={"GRADSYNC_COLLECTIVE_TIMEOUT_S": "-1"}
    )
    assert result.returncode == 2, result
    assert "collective_timeout_s" in result.stderr, result.stderr
    assert "GRADSYNC_COLLECTIVE_TIMEOUT_S" in result.stderr, result.stderr
    assert not os.path.exists(socket_path)


@pytest.mark.timeout(60)
def test_gradsyncd_with_bad_flag_exits_2(short_tmp: str) -> None:
    result = run_gradsyncd("--socket", f"ipc://{short_tmp}/never.sock", "--threads", "0")
    assert result.returncode == 2, result
    assert "threads" in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_gradsyncd_refuses_an_abbreviated_flag(short_tmp: str) -> None:
    """`--thread 4` is a typo to report, not a guess at --threads."""
    result = run_gradsyncd("--socket", f"ipc://{short_tmp}/never.sock", "--thread", "4")
    assert result.returncode == 2, result
    assert "unrecognized arguments: --thread" in result.stderr, result.stderr
    assert not os.path.exists(f"{short_tmp}/never.sock")


@pytest.mark.timeout(60)
def test_running_daemon_reports_the_winning_timeout(
    start_daemon: StartDaemon, short_tmp: str
) -> None:
    toml = write_toml(Path(short_tmp), "collective_timeout_s = 7\n")
    from_toml = start_daemon("--config", toml)
    from_env = start_daemon("--config", toml, env={"GRADSYNC_COLLECTIVE_TIMEOUT_S": "5"})
    from_flag = start_daemon(
        "--config", toml, "--collective-timeout-s", "3",
        env={"GRADSYNC_COLLECTIVE_TIMEOUT_S": "5"},
    )
    assert query(from_toml.endpoint, 5.0)["collective_timeout_s"] == 7.0
    assert query(from_env.endpoint, 5.0)["collective_timeout_s"] == 5.0
    assert query(from_flag.endpoint, 5.0)["collective_timeout_s"] == 3.0


@pytest.mark.timeout(60)
def test_a_bare_socket_path_is_taken_as_ipc_and_its_stats_endpoint_works(
    short_tmp: str,
) -> None:
    """`--socket /PATH` (no ipc://) is `ipc:///PATH`: the daemon stays up, and its
    statistics answer beside the socket, read by `gradsync stats --daemon /PATH`."""
    assert load_config(flags={"socket": "/run/x.sock"}, environ={}).socket == "ipc:///run/x.sock"
    path = f"{short_tmp}/plain.sock"
    log_path = Path(short_tmp) / "plain.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [GRADSYNCD, "--socket", path], stdout=log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=CLEAN_ENV,
        )
    daemon = DaemonProcess(f"ipc://{path}", short_tmp, process, log_path)
    try:
        wait_until_ready(path, process, log_path)
        assert fetch_snapshot(f"ipc://{path}.stats", 5.0)["pid"] == process.pid
        table = subprocess.run(
            [sys.executable, "-m", "gradsync.client.cli", "stats", "--daemon", path],
            capture_output=True, text=True, timeout=30, env=CLEAN_ENV,
        )
        assert table.returncode == 0 and f"pid {process.pid}" in table.stdout, table
        daemon.assert_alive()
    finally:
        assert daemon.stop() == 0, daemon.log()
