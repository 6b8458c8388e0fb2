"""Raw AEAD throughput on one core: what encrypting the data streams can cost.

    python -m benchmarks.aead [--budget-s 0.3]

Per record size (64 KiB to 4 MiB), on one core, through the `cryptography`
package (OpenSSL): AES-256-GCM and ChaCha20-Poly1305 encrypting and
decrypting into preallocated buffers (`encrypt_into`/`decrypt_into`, what the
data streams use), AES-256-GCM allocating its output (`encrypt`/`decrypt`),
the low-level `Cipher(AES, GCM).decryptor().update_into` path, a numpy copy
for scale, and TLS 1.3 (Python's `ssl`, AES-256-GCM, 16 KiB records) through
memory BIOs, the other way to encrypt a stream.  `--no-aes-ni` adds the two
AEADs with OpenSSL told (`OPENSSL_ia32cap`) that the CPU has no AES or
carry-less multiply instructions: what a CPU without them gets, and why the data streams fall back
to ChaCha20-Poly1305 there.  `interdaemon.py` records the same figures
beside its CURVE cells.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

KIB = 1024
SIZES = (64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB)
#: OPENSSL_ia32cap: clear AES-NI (bit 57) and PCLMULQDQ (bit 33) of the first word
#: and VAES (41) and VPCLMULQDQ (42) of the second, keeping every other flag (AVX2,
#: which ChaCha20 uses), so OpenSSL takes its software AES and GHASH, as on a CPU
#: without AES instructions.  (A first word alone would zero the second.)
NO_AES_NI = "~0x200000200000000:~0x60000000000"


def _rate(step: Callable[[], object], nbytes: int, budget_s: float) -> float:
    """GB/s of `step` (which moves `nbytes`), best of three timed stretches."""
    step()
    best = 0.0
    for _ in range(3):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < budget_s / 3 or count < 2:
            step()
            count += 1
        best = max(best, nbytes * count / elapsed / 1e9)
    return best


def measure_aead(
    sizes: Sequence[int] = SIZES, budget_s: float = 0.3
) -> list[tuple[str, int, float, float]]:
    """`(method, record bytes, encrypt GB/s, decrypt GB/s)` rows, one core."""
    key, nonce = os.urandom(32), os.urandom(12)
    rows: list[tuple[str, int, float, float]] = []
    for size in sizes:
        rows += _rows_for(size, key, nonce, budget_s)
    tls = measure_tls(budget_s)
    if tls is not None:
        rows.append(("TLS 1.3 AES-256-GCM (ssl, memory BIOs)", 1024 * KIB, *tls))
    rows.append(("AES-256-GCM *_into, 2 threads (total)", 1024 * KIB,
                 *measure_threads(1024 * KIB, 2, budget_s)))
    return rows


def measure_threads(size: int, threads: int, budget_s: float) -> tuple[float, float]:
    """(encrypt, decrypt) GB/s of `threads` threads together, each sealing and then
    opening its own records with AES-256-GCM `*_into`: above one thread's rate only
    because `cryptography` lets go of the GIL while it works (from 2 KiB on)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key, nonce = os.urandom(32), os.urandom(12)
    start = threading.Barrier(threads)
    moved = [[0, 0] for _ in range(threads)]
    elapsed = [0.0, 0.0]

    def work(index: int) -> None:
        cipher, data = AESGCM(key), os.urandom(size)
        sealed, opened = bytearray(size + 16), bytearray(size)
        steps = (lambda: cipher.encrypt_into(nonce, data, None, sealed),
                 lambda: cipher.decrypt_into(nonce, sealed, None, opened))
        for which, step in enumerate(steps):
            step()
            start.wait()
            began = time.perf_counter()
            while time.perf_counter() - began < budget_s / 2:
                step()
                moved[index][which] += size
            elapsed[which] = max(elapsed[which], time.perf_counter() - began)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return tuple(sum(m[which] for m in moved) / elapsed[which] / 1e9  # type: ignore[return-value]
                 for which in (0, 1))


def _rows_for(
    size: int, key: bytes, nonce: bytes, budget_s: float
) -> list[tuple[str, int, float, float]]:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    rows = _aead_rows(size, key, nonce, budget_s)
    data = os.urandom(size)
    sealed = bytearray(size + 16)
    aes = AESGCM(key)
    whole = aes.encrypt(nonce, data, None)
    rows.append(("AES-256-GCM allocating", size,
                 _rate(lambda: aes.encrypt(nonce, data, None), size, budget_s),
                 _rate(lambda: aes.decrypt(nonce, whole, None), size, budget_s)))

    def low_level_encrypt() -> bytes:
        encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        encryptor.update_into(data, sealed)
        encryptor.finalize()
        return encryptor.tag

    tag, body = low_level_encrypt(), bytes(sealed[:size])

    def low_level_decrypt() -> None:
        decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).decryptor()
        decryptor.update_into(body, sealed)
        decryptor.finalize_with_tag(tag)

    rows.append(("AES-256-GCM Cipher.update_into", size,
                 _rate(low_level_encrypt, size, budget_s),
                 _rate(low_level_decrypt, size, budget_s)))
    source = np.frombuffer(data, np.uint8)
    target = np.empty_like(source)
    copy = _rate(lambda: np.copyto(target, source), size, budget_s)
    rows.append(("numpy copy (for scale)", size, copy, copy))
    return rows


def _aead_rows(
    size: int, key: bytes, nonce: bytes, budget_s: float
) -> list[tuple[str, int, float, float]]:
    """AES-256-GCM and ChaCha20-Poly1305 into preallocated buffers (as the streams)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    rows: list[tuple[str, int, float, float]] = []
    data = os.urandom(size)
    sealed, opened = bytearray(size + 16), bytearray(size)
    for name, cipher in (("AES-256-GCM", AESGCM(key)),
                         ("ChaCha20-Poly1305", ChaCha20Poly1305(key))):
        cipher.encrypt_into(nonce, data, None, sealed)
        encrypt = _rate(lambda c=cipher: c.encrypt_into(nonce, data, None, sealed),
                        size, budget_s)
        decrypt = _rate(lambda c=cipher: c.decrypt_into(nonce, sealed, None, opened),
                        size, budget_s)
        rows.append((f"{name} *_into", size, encrypt, decrypt))
    return rows


def measure_without_aes_ni(
    size: int = 1024 * KIB, budget_s: float = 0.3
) -> list[tuple[str, int, float, float]]:
    """The AEAD rows in a child whose OpenSSL believes the CPU lacks AES-NI and
    PCLMULQDQ (x86 only: elsewhere, or if the child fails, no rows)."""
    from gradsync.daemon.peers.stream_crypto import has_aes_instructions

    if not has_aes_instructions() or os.uname().machine not in ("x86_64", "i686"):
        return []
    env = {**os.environ, "OPENSSL_ia32cap": NO_AES_NI}
    command = [sys.executable, "-m", "benchmarks.aead", "--aead-json", str(size),
               "--budget-s", str(budget_s)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                              timeout=120)
        rows = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    return [(f"{method} (AES-NI masked)", int(nbytes), float(enc), float(dec))
            for method, nbytes, enc, dec in rows]


def measure_tls(budget_s: float = 0.3) -> tuple[float, float] | None:
    """TLS 1.3 through Python's ssl: (encrypt, decrypt) GB/s of 1 MiB writes."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gradsync-bench")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    with tempfile.TemporaryDirectory() as folder:
        cert_path, key_path = f"{folder}/cert.pem", f"{folder}/key.pem"
        with open(cert_path, "wb") as file:
            file.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(key_path, "wb") as file:
            file.write(key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(cert_path, key_path)
        client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client_ctx.check_hostname = False
        client_ctx.load_verify_locations(cert_path)
    for ctx in (server_ctx, client_ctx):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for end in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                end.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    if client.version() != "TLSv1.3":
        return None
    payload = os.urandom(1024 * KIB)
    target = memoryview(bytearray(len(payload)))
    encrypting = decrypting = 0.0
    count = 0
    while encrypting + decrypting < budget_s or count < 4:
        start = time.perf_counter()
        client.write(payload)
        record = c_out.read()
        middle = time.perf_counter()
        s_in.write(record)
        got = 0
        while got < len(payload):
            got += server.read(len(payload) - got, target[got:])
        encrypting += middle - start
        decrypting += time.perf_counter() - middle
        count += 1
    moved = count * len(payload) / 1e9
    return moved / encrypting, moved / decrypting


def format_table(rows: Sequence[tuple[str, int, float, float]]) -> str:
    lines = ["| method | record | encrypt GB/s | decrypt GB/s |", "|---|---:|---:|---:|"]
    for method, size, encrypt, decrypt in rows:
        lines.append(f"| {method} | {size // KIB} KiB | {encrypt:.2f} | {decrypt:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=0.3,
                        help="timed seconds per method and size (default 0.3)")
    parser.add_argument("--no-aes-ni", action="store_true",
                        help="also the AEADs with AES-NI masked (1 MiB records)")
    parser.add_argument("--aead-json", type=int, metavar="BYTES",
                        help=argparse.SUPPRESS)  # the child of measure_without_aes_ni
    args = parser.parse_args(argv)
    if args.aead_json:
        rows = _aead_rows(args.aead_json, os.urandom(32), os.urandom(12), args.budget_s)
        print(json.dumps(rows))
        return 0
    rows = measure_aead(budget_s=args.budget_s)
    if args.no_aes_ni:
        rows += measure_without_aes_ni(budget_s=args.budget_s)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
