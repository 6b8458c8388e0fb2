"""`gradsync keygen`: create the CURVE keypair of one daemon.

Writes `NAME.key` (public: copy it into the authorized folder of every daemon
of the cluster) and `NAME.key_secret` (secret: stays on this node, mode 0600)
in pyzmq's certificate format.  `--endpoint` records in both files where this
daemon listens for peers; the other daemons look a peer's server key up by
that endpoint.  Existing files are never overwritten: replacing a key is a
deliberate act (delete the old files first).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import sys

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|\*|[A-Za-z0-9._-]+):(\d{1,5})$")
_WILDCARDS = ("*", "0.0.0.0", "[::]")

_PUBLIC_BANNER = (
    "#   ****  Generated on {now} by gradsync keygen  ****\n"
    "#   ZeroMQ CURVE Public Certificate\n"
    "#   Copy into the authorized keys folder of every daemon of the cluster.\n\n"
)
_SECRET_BANNER = (
    "#   ****  Generated on {now} by gradsync keygen  ****\n"
    "#   ZeroMQ CURVE **Secret** Certificate\n"
    "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n"
)


def check_endpoint(endpoint: str) -> str:
    """Accept `tcp://HOST:PORT` with a host others can connect to (no wildcard)."""
    match = _ENDPOINT.match(endpoint)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"endpoint {endpoint!r} must look like tcp://HOST:PORT")
    if match.group(1) in _WILDCARDS:
        raise ValueError(f"endpoint {endpoint!r} is a wildcard; give the address peers dial")
    return endpoint


def _certificate(banner: str, public: str, secret: str | None, endpoint: str | None) -> str:
    lines = [banner.format(now=datetime.datetime.now().isoformat(timespec="seconds"))]
    lines.append("metadata\n")
    if endpoint is not None:
        lines.append(f'    endpoint = "{endpoint}"\n')
    lines.append("curve\n")
    lines.append(f'    public-key = "{public}"\n')
    if secret is not None:
        lines.append(f'    secret-key = "{secret}"\n')
    return "".join(lines)


def generate_keypair(
    directory: str, name: str, endpoint: str | None = None
) -> tuple[str, str]:
    """Write `DIR/NAME.key` and `DIR/NAME.key_secret` (0600); return their paths.

    Raises `FileExistsError` if either file exists (nothing is written then),
    `ValueError` for a bad name or endpoint.
    """
    if not _NAME.match(name):
        raise ValueError(
            f"key name {name!r} must be 1-128 letters, digits, '.', '_' or '-', "
            "not starting with a punctuation mark"
        )
    if endpoint is not None:
        check_endpoint(endpoint)
    import zmq  # here, not at the top: `gradsync` imports this module for its options

    os.makedirs(directory, mode=0o700, exist_ok=True)
    public_key, secret_key = (key.decode("ascii") for key in zmq.curve_keypair())
    public_path = os.path.join(directory, name + ".key")
    secret_path = os.path.join(directory, name + ".key_secret")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    created: list[str] = []
    try:
        # Claim both names before writing either, so a clash leaves nothing behind.
        secret_fd = os.open(secret_path, flags, 0o600)
        created.append(secret_path)
        with os.fdopen(secret_fd, "w", encoding="ascii") as secret_file:
            os.fchmod(secret_file.fileno(), 0o600)  # whatever the umask
            public_fd = os.open(public_path, flags, 0o644)
            created.append(public_path)
            with os.fdopen(public_fd, "w", encoding="ascii") as public_file:
                public_file.write(_certificate(_PUBLIC_BANNER, public_key, None, endpoint))
            secret_file.write(_certificate(_SECRET_BANNER, public_key, secret_key, endpoint))
    except BaseException:
        for path in created:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return public_path, secret_path


def write_public_certificate(path: str, public_key: str, endpoint: str) -> None:
    """Write another daemon's public certificate (its key and where it listens) to `path`."""
    check_endpoint(endpoint)
    text = _certificate(_PUBLIC_BANNER, public_key, None, endpoint)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags, 0o644), "w", encoding="ascii") as handle:
        handle.write(text)


def add_keygen_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="folder for the two files")
    parser.add_argument("--name", required=True, help="base name: writes NAME.key, "
                        "NAME.key_secret (e.g. the node's host name)")
    role = parser.add_mutually_exclusive_group()
    role.add_argument("--endpoint", default=None, metavar="tcp://HOST:PORT",
                      help="where this daemon listens for peers, as the others dial it; "
                      "recorded in the key so that they find it (required for CURVE links)")
    role.add_argument("--reader", action="store_true",
                      help="a key for reading statistics (gradsync stats/top/trace "
                      "--curve-secret), not a daemon's: it needs no endpoint")


def run_keygen(args: argparse.Namespace) -> int:
    """Run `gradsync keygen`; 0 on success, 1 with a message on stderr otherwise."""
    try:
        public_path, secret_path = generate_keypair(args.directory, args.name, args.endpoint)
    except FileExistsError as exc:
        print(
            f"gradsync keygen: {exc.filename} exists; refusing to overwrite a key "
            "(delete both NAME.key and NAME.key_secret first to replace it)",
            file=sys.stderr,
        )
        return 1
    except (ValueError, OSError) as exc:
        print(f"gradsync keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public_path}  (copy into the authorized folder of every daemon)")
    print(f"secret key: {secret_path}  (mode 0600; keep on this node, pass as --curve-secret)")
    if args.endpoint is None and not args.reader:
        print("note: no --endpoint recorded; peers cannot find this daemon's server key "
              "until its .key records 'endpoint = \"tcp://HOST:PORT\"' in its metadata "
              "(a key only for reading statistics needs none: pass --reader)")
    return 0
