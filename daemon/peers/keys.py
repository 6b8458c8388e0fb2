"""CURVE key files: a daemon's secret certificate and the authorised public ones.

The files use pyzmq's (czmq's) certificate format, as `gradsync keygen` writes
it: a `metadata` section of `name = "value"` lines, then a `curve` section with
`public-key` and, in the secret file only, `secret-key` (Z85 text).  The
metadata entry `endpoint` names the `tcp://HOST:PORT` the key's daemon listens
on; that is how a daemon finds the server key of a peer it knows only by
endpoint (`load_peer_keys`; see `gradsync.daemon.peers.links`).

Loading is strict: a secret file readable by group or others, a key that is
not 32 bytes of Z85, or a folder anyone may write to is refused at start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Mapping

from zmq.utils import z85

from gradsync.daemon.errors import ConfigError
from gradsync.daemon.peers.endpoints import TcpEndpoint, parse_tcp_endpoint, same_endpoint

log = logging.getLogger("gradsync.daemon.peers")

_KEY_CHARS = 40
_MAX_CERT_BYTES = 64 * 1024


class KeyFileError(ConfigError):
    """A key file or folder that cannot be used; the message names it and says why."""


@dataclasses.dataclass(frozen=True)
class CurveConfig:
    """This daemon's secret certificate and the folder of authorised public ones."""

    secret_file: str
    authorized_dir: str


@dataclasses.dataclass(frozen=True)
class PeerKeys:
    """What the peer links need of the keys: ours, the authorised ones, each peer's."""

    #: Our (public, secret) key, Z85.
    secret: tuple[bytes, bytes]
    authorized: set[bytes]
    #: Per peer, in the order given, the server key its certificate records.
    server_keys: dict[str, bytes]


@dataclasses.dataclass(frozen=True)
class Certificate:
    """One certificate file: its keys (Z85 bytes) and metadata."""

    path: str
    public_key: bytes
    secret_key: bytes | None
    metadata: dict[str, str]

    @property
    def endpoint(self) -> str | None:
        """The `endpoint` metadata: where this key's daemon listens, if recorded."""
        return self.metadata.get("endpoint")


def _check_key(path: str, name: str, value: str) -> bytes:
    key = value.encode("ascii", errors="replace")
    if len(key) != _KEY_CHARS:
        raise KeyFileError(f"{path}: {name} must be {_KEY_CHARS} Z85 characters, got {len(key)}")
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError):
        raise KeyFileError(f"{path}: {name} is not valid Z85 text") from None
    return key


def parse_certificate(path: str, text: str) -> Certificate:
    """Parse certificate text (the ZPL subset pyzmq writes); raise `KeyFileError`."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        # Whole-line comments only: Z85 keys may contain '#'.
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            current = sections.setdefault(line.strip(), {})
            continue
        name, sep, value = line.strip().partition("=")
        if current is None or not sep:
            raise KeyFileError(f"{path}:{number}: expected 'name = \"value\"' inside a section")
        current[name.strip()] = value.strip().strip("\"'")
    curve = sections.get("curve", {})
    if "public-key" not in curve:
        raise KeyFileError(f"{path} holds no public-key: not a CURVE certificate")
    secret = curve.get("secret-key")
    return Certificate(
        path=path,
        public_key=_check_key(path, "public-key", curve["public-key"]),
        secret_key=None if secret is None else _check_key(path, "secret-key", secret),
        metadata=dict(sections.get("metadata", {})),
    )


def _read_text(path: str, fd: int) -> str:
    data = os.read(fd, _MAX_CERT_BYTES + 1)
    if len(data) > _MAX_CERT_BYTES:
        raise KeyFileError(f"{path} is larger than {_MAX_CERT_BYTES} bytes: not a certificate")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"{path} is not UTF-8 text: not a certificate") from None


def read_certificate(path: str) -> Certificate:
    """Read and parse one certificate file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    try:
        return parse_certificate(path, _read_text(path, fd))
    finally:
        os.close(fd)


def load_secret(path: str) -> Certificate:
    """Load this daemon's secret certificate; refuse one that others may read.

    The mode is checked on the open file (no race with a chmod in between).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"cannot read secret key file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"secret key file {path} is not a regular file")
        cert = parse_certificate(path, _read_text(path, fd))
    finally:
        os.close(fd)
    # A public key first: its mode 0644 is right for it, and "consider the key
    # leaked" would send its owner off to replace a key that is fine.
    if cert.secret_key is None:
        raise KeyFileError(
            f"{path} is a public key (it holds no secret-key): pass the NAME.key_secret "
            "that `gradsync keygen` wrote beside it"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"secret key file {path} has mode {mode:04o}: it is readable by group or "
            f"others; run `chmod 600 {path}` (and consider the key leaked)"
        )
    return cert


def load_authorized_certificates(directory: str) -> list[Certificate]:
    """Every `*.key` certificate in `directory`, sorted by file name.

    Refuses a folder that group or others may write to (anyone could then
    authorise a key) and a folder without any key.
    """
    try:
        info = os.stat(directory)
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise KeyFileError(
            f"cannot read authorized keys folder {directory}: {exc.strerror}"
        ) from None
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeyFileError(
            f"authorized keys folder {directory} has mode {stat.S_IMODE(info.st_mode):04o}: "
            f"group or others may add keys to it; run `chmod go-w {directory}`"
        )
    certs = [
        read_certificate(os.path.join(directory, name))
        for name in names
        if name.endswith(".key") and os.path.isfile(os.path.join(directory, name))
    ]
    if not certs:
        raise KeyFileError(
            f"authorized keys folder {directory} holds no *.key files; copy there the "
            "NAME.key of every daemon of the cluster (written by `gradsync keygen`)"
        )
    return certs


def load_authorized(directory: str) -> set[bytes]:
    """The public keys (Z85 bytes) of every `*.key` certificate in `directory`."""
    return {cert.public_key for cert in load_authorized_certificates(directory)}


def load_peer_keys(curve: CurveConfig, peers: Mapping[str, TcpEndpoint]) -> PeerKeys:
    """Load our secret and the authorised keys; find each peer's server key.

    The key of peer P is the one whose certificate records an endpoint that is
    the same socket as P's; none, or several, is a `KeyFileError`.
    """
    secret = load_secret(curve.secret_file)
    assert secret.secret_key is not None  # load_secret guarantees it
    certs = load_authorized_certificates(curve.authorized_dir)
    authorized = {cert.public_key for cert in certs}
    if secret.public_key not in authorized:
        log.warning(
            "the public key of %s is not in %s: peers using the same authorized "
            "folder will refuse this daemon", curve.secret_file, curve.authorized_dir,
        )
    recorded: list[tuple[TcpEndpoint, bytes, str]] = []
    for cert in certs:
        if cert.endpoint is None:
            continue
        try:
            recorded.append((parse_tcp_endpoint(cert.endpoint), cert.public_key, cert.path))
        except ValueError as exc:
            raise KeyFileError(f"{cert.path}: bad 'endpoint' metadata: {exc}") from None
    server_keys: dict[str, bytes] = {}
    for name, endpoint in peers.items():
        matches = {(key, path) for ep, key, path in recorded if same_endpoint(ep, endpoint)}
        keys = {key for key, _ in matches}
        if not keys:
            raise KeyFileError(
                f"no key in {curve.authorized_dir} records the endpoint of peer "
                f"{name}: copy that daemon's NAME.key there, written by "
                f"`gradsync keygen DIR --name NAME --endpoint {name}` (or add "
                f"'endpoint = \"{name}\"' to the metadata section of its .key)"
            )
        if len(keys) > 1:
            raise KeyFileError(
                f"several keys in {curve.authorized_dir} record the endpoint of peer "
                f"{name}: {', '.join(sorted(path for _, path in matches))}"
            )
        server_keys[name] = keys.pop()
    return PeerKeys((secret.public_key, secret.secret_key), authorized, server_keys)
