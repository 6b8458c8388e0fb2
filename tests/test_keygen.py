"""`gradsync keygen` and the loading of key files by the daemon."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth
from cluster import free_ports

from gradsync.client.cli.keygen import add_keygen_arguments, generate_keypair, run_keygen
from gradsync.daemon.peers import (
    KeyFileError,
    load_authorized,
    load_authorized_certificates,
    load_secret,
)

pytestmark = pytest.mark.timeout(30)
GRADSYNCD = os.path.join(os.path.dirname(sys.executable), "gradsyncd")


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def keygen(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_keygen_arguments(parser)
    return run_keygen(parser.parse_args(list(argv)))


def test_writes_pyzmq_certificates_with_private_secret(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # even a permissive umask must not widen the secret file
    try:
        public, secret = generate_keypair(str(tmp_path / "keys"), "node1", "tcp://node1:7070")
    finally:
        os.umask(old_umask)
    assert (public, secret) == (
        str(tmp_path / "keys" / "node1.key"), str(tmp_path / "keys" / "node1.key_secret")
    )
    assert mode(secret) == 0o600
    assert mode(public) == 0o644
    # pyzmq reads both files back: same public key, the secret only in the secret file.
    public_key, none = zmq.auth.load_certificate(public)
    public_again, secret_key = zmq.auth.load_certificate(secret)
    assert none is None and secret_key is not None and public_key == public_again
    assert zmq.curve_public(secret_key) == public_key
    cert = load_secret(secret)
    assert (cert.public_key, cert.secret_key, cert.endpoint) == (
        public_key, secret_key, "tcp://node1:7070"
    )


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    public, secret = generate_keypair(str(tmp_path), "node1")
    before = Path(public).read_bytes(), Path(secret).read_bytes()
    with pytest.raises(FileExistsError):
        generate_keypair(str(tmp_path), "node1")
    assert (Path(public).read_bytes(), Path(secret).read_bytes()) == before
    # Half a pair in the way: nothing new is left behind either.
    os.unlink(secret)
    with pytest.raises(FileExistsError):
        generate_keypair(str(tmp_path), "node1")
    assert sorted(os.listdir(tmp_path)) == ["node1.key"]


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "k")
    assert keygen(folder, "--name", "n1", "--endpoint", "tcp://10.0.0.1:7070") == 0
    assert "n1.key_secret" in capsys.readouterr().out
    assert keygen(folder, "--name", "n1") == 1
    assert "refusing to overwrite" in capsys.readouterr().err
    assert keygen(folder, "--name", "../escape") == 1
    assert keygen(folder, "--name", "n2", "--endpoint", "tcp://*:7070") == 1
    assert "wildcard" in capsys.readouterr().err
    assert sorted(os.listdir(folder)) == ["n1.key", "n1.key_secret"]


def test_a_reader_key_needs_no_endpoint_and_gets_no_note_about_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert keygen(str(tmp_path), "--name", "ops", "--reader") == 0
    out = capsys.readouterr().out
    assert "ops.key_secret" in out and "note:" not in out, out
    assert load_secret(str(tmp_path / "ops.key_secret")).endpoint is None
    # A daemon's key without --endpoint still gets the note.
    assert keygen(str(tmp_path), "--name", "node1") == 0
    assert "note: no --endpoint recorded" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a reader's key has no endpoint to record
        keygen(str(tmp_path), "--name", "both", "--reader", "--endpoint", "tcp://h:1")


def test_gradsyncd_given_a_public_key_as_its_secret_says_so(short_tmp: str) -> None:
    folder = Path(short_tmp)
    ours, theirs = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    public, _ = generate_keypair(str(folder / "keys"), "node1", ours)
    (folder / "authorized").mkdir(mode=0o755)
    shutil.copy(public, folder / "authorized")
    result = subprocess.run(
        [GRADSYNCD, "--socket", f"ipc://{short_tmp}/never.sock",
         "--listen", ours, "--peers", f"{ours},{theirs}",
         "--curve-secret", public, "--curve-authorized", str(folder / "authorized")],
        capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")},
    )
    assert result.returncode == 2, result
    assert f"{public} is a public key" in result.stderr, result.stderr
    assert "leaked" not in result.stderr, result.stderr


def test_secret_readable_by_group_or_others_is_refused(tmp_path: Path) -> None:
    _, secret = generate_keypair(str(tmp_path), "node1")
    for loose in (0o644, 0o640, 0o604):
        os.chmod(secret, loose)
        with pytest.raises(KeyFileError, match=rf"{secret} has mode {loose:04o}"):
            load_secret(secret)
    os.chmod(secret, 0o400)
    assert load_secret(secret).secret_key is not None


def test_file_without_secret_key_is_refused(tmp_path: Path) -> None:
    public, _ = generate_keypair(str(tmp_path), "node1")
    # At its usual mode 0644: said to be a public key, not a leaked secret one.
    with pytest.raises(KeyFileError, match="is a public key") as caught:
        load_secret(public)
    assert "chmod" not in str(caught.value) and "leaked" not in str(caught.value)
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text('curve\n    public-key = "short"\n')
    os.chmod(garbage, 0o600)
    with pytest.raises(KeyFileError, match="40 Z85 characters"):
        load_secret(str(garbage))
    with pytest.raises(KeyFileError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))


def test_load_authorized(tmp_path: Path) -> None:
    folder = tmp_path / "authorized"
    folder.mkdir(mode=0o755)
    keys = set()
    for name in ("a", "b"):
        public, _ = generate_keypair(str(tmp_path / name), name, f"tcp://{name}:7070")
        keys.add(zmq.auth.load_certificate(public)[0])
        os.replace(public, folder / f"{name}.key")
    (folder / "README").write_text("not a key")
    assert load_authorized(str(folder)) == keys
    assert [c.endpoint for c in load_authorized_certificates(str(folder))] == [
        "tcp://a:7070", "tcp://b:7070"
    ]
    os.chmod(folder, 0o775)
    with pytest.raises(KeyFileError, match="group or others may add keys"):
        load_authorized(str(folder))
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match=r"holds no \*\.key files"):
        load_authorized(str(empty))
