"""Sealing the data streams of CURVE links: keys agreed over CURVE, AEAD records.

Why this and not TLS: measured on this project's 2-core machine
(benchmarks/aead.py), AES-256-GCM through `cryptography` seals and opens
1 MiB records at 9-10 GB/s per core into preallocated buffers, while TLS 1.3
through Python's `ssl` (16 KiB records, copies through its buffers) moved
about 1.1 GB/s, and TLS would need certificates pinned to the CURVE keys.

The cipher, per link.  AES-256-GCM is fast only with AES instructions (AES-NI;
`aes` among /proc/cpuinfo's flags); without them ChaCha20-Poly1305 (3.2-3.6
GB/s here), designed for software, is the faster one.  So each daemon's offer
names the cipher it runs fast (`fast_cipher()`), and the sending daemon uses
AES-256-GCM only if both ends name it, ChaCha20-Poly1305 otherwise.  The hello
states the choice, the key derivation binds it, and the receiver refuses AES
from a peer whose offer did not allow it: a man in the middle who changes the
choice only breaks the proof.

Key agreement.  The receiving daemon B keeps, per peer A, an *offer*: a random
16-byte token and an ephemeral X25519 key.  Its answers to A's link probes
(over CURVE ZeroMQ, so encrypted and authenticated both ways) carry the data
port, the token, the offer's public key and its cipher, to A alone.  A makes a fresh
X25519 key for each stream it opens and derives with HKDF-SHA256 (the X25519
secret as input, the token as salt, both public keys and A's name as info,
with the cipher's name) a 256-bit key, a 4-byte nonce prefix and a 16-byte
proof.  Its hello (in the clear) carries its name, the cipher (one byte), its
public key and the proof; nothing secret.  B derives the same and accepts the
stream only if the proof matches, then replaces its offer to A: a hello (or a
whole stream) recorded and played again later does not match the new offer and
is refused.  Without the token, which only ever travelled over CURVE, no one
else can derive the key, even with the public keys; each stream has its own
key, dropped with the stream.

Records.  After the hello the stream is a sequence of records: the plaintext
length (4 bytes, big-endian, 1 to `RECORD_BYTES`), the ciphertext, a 16-byte
tag.  The length is the associated data; the nonce is the prefix and a
64-bit counter of the records so far, never sent: the receiver opens record
n with nonce n, so a record replayed, dropped, reordered or altered fails
authentication, and the stream with it.  The plaintext the records carry is
the plain stream's message format (see `stream.py`).
"""

from __future__ import annotations

import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gradsync.protocol.peer import STREAM_CIPHERS

#: Plaintext bytes per record, at most (sealing runs at its full rate from 64 KiB on).
RECORD_BYTES = 1024 * 1024
TAG_BYTES = 16
LENGTH = struct.Struct("!I")
#: Bytes a record adds to its plaintext.
RECORD_OVERHEAD = LENGTH.size + TAG_BYTES
KEY_BYTES = 32
PROOF_BYTES = 16
#: What a sealed stream's hello carries after the name: cipher, public key, proof.
HELLO_SECRET_BYTES = 1 + KEY_BYTES + PROOF_BYTES
_INFO = b"gradsync data stream v2\x00"
_COUNTER = struct.Struct("!Q")

AES_GCM, CHACHA = STREAM_CIPHERS
#: The AEAD of each cipher name (both take 32-byte keys and 12-byte nonces).
_AEADS: dict[str, type[AESGCM] | type[ChaCha20Poly1305]] = {
    AES_GCM: AESGCM, CHACHA: ChaCha20Poly1305}
#: How the log names them.
CIPHER_TITLES = {AES_GCM: "AES-256-GCM", CHACHA: "ChaCha20-Poly1305"}


def has_aes_instructions(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AES instructions: `aes` among the flags (x86's AES-NI)
    or features (ARMv8's crypto extension) of /proc/cpuinfo; False if unreadable."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                label, _, values = line.partition(":")
                if label.strip() in ("flags", "Features"):
                    return "aes" in values.split()
    except OSError:
        pass
    return False


def fast_cipher() -> str:
    """The cipher this CPU seals fastest: AES-256-GCM with AES instructions,
    ChaCha20-Poly1305 without."""
    return AES_GCM if has_aes_instructions() else CHACHA


def choose_cipher(mine: str, theirs: str) -> str:
    """The cipher of a stream between daemons whose fast ciphers are `mine` and
    `theirs`: AES-256-GCM only if it is both's."""
    return AES_GCM if mine == theirs == AES_GCM else CHACHA


class StreamAuthError(Exception):
    """A record (or a hello's proof) failed authentication."""


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _derive(
    shared: bytes, token: bytes, name: str, cipher: str, sender_key: bytes,
    receiver_key: bytes,
) -> tuple[bytes, bytes, bytes]:
    """(key, nonce prefix, proof) of one `cipher` stream from `name` to the offer's owner."""
    info = (_INFO + name.encode() + b"\x00" + cipher.encode() + b"\x00" + sender_key
            + receiver_key)
    okm = HKDF(hashes.SHA256(), KEY_BYTES + 4 + PROOF_BYTES, token, info).derive(shared)
    return okm[:KEY_BYTES], okm[KEY_BYTES : KEY_BYTES + 4], okm[KEY_BYTES + 4 :]


class _NumberedRecords:
    """One direction of a sealed stream: its AEAD and the number of the next
    record, whose nonce is the stream's prefix and that number."""

    def __init__(self, key: bytes, prefix: bytes, cipher: str) -> None:
        self.cipher = cipher
        self._aead = _AEADS[cipher](key)
        self._prefix = prefix
        self._count = 0

    def _nonce(self) -> bytes:
        return self._prefix + _COUNTER.pack(self._count)


class RecordSealer(_NumberedRecords):
    """Seals one stream's records, numbering them from 0."""

    def seal_into(self, plain: memoryview, out: memoryview) -> int:
        """Write the record of `plain` (1 to RECORD_BYTES bytes) at the start of
        `out`; returns its size, len(plain) + RECORD_OVERHEAD."""
        size = plain.nbytes
        length = LENGTH.pack(size)
        out[: LENGTH.size] = length
        nonce = self._nonce()
        self._count += 1
        self._aead.encrypt_into(nonce, plain, length, out[LENGTH.size : LENGTH.size + size
                                                          + TAG_BYTES])
        return size + RECORD_OVERHEAD


class RecordOpener(_NumberedRecords):
    """Opens one stream's records, in order, numbering them from 0."""

    def open_into(self, length: bytes, sealed: memoryview, out: memoryview) -> None:
        """Open the next record (`sealed`: ciphertext and tag) into `out` (exactly
        its plaintext size).  Raises StreamAuthError; `out` then holds garbage."""
        nonce = self._nonce()
        try:
            self._aead.decrypt_into(nonce, sealed, length, out)
        except InvalidTag:
            raise StreamAuthError(
                f"record {self._count} failed authentication (altered, replayed or out of order)"
            ) from None
        self._count += 1


class Offer:
    """What a receiving daemon offers one peer: a token, an ephemeral key, and the
    cipher it runs fast (`cipher`, one of STREAM_CIPHERS)."""

    def __init__(self, cipher: str) -> None:
        if cipher not in _AEADS:
            raise ValueError(f"unknown stream cipher {cipher!r}")
        self.token = os.urandom(16)
        self.cipher = cipher
        self._key = X25519PrivateKey.generate()
        #: The public half, advertised with the token over CURVE.
        self.public = _public_bytes(self._key)

    def accept(self, name: str, secret: bytes) -> RecordOpener:
        """The opener of a stream whose hello gave `name` and `secret` (the
        sender's cipher, public key and proof); raises StreamAuthError if the
        proof does not match (the sender did not get this offer) or the cipher
        is one the offer did not allow."""
        if len(secret) != HELLO_SECRET_BYTES:
            raise StreamAuthError("the hello carries no cipher, key and proof")
        if secret[0] >= len(STREAM_CIPHERS):
            raise StreamAuthError(f"the hello names an unknown cipher ({secret[0]})")
        cipher = STREAM_CIPHERS[secret[0]]
        if cipher != choose_cipher(cipher, self.cipher):
            raise StreamAuthError(f"the hello chose {CIPHER_TITLES[cipher]}, which our "
                                  f"offer ({CIPHER_TITLES[self.cipher]}) did not allow")
        sender_key, proof = secret[1 : 1 + KEY_BYTES], secret[1 + KEY_BYTES :]
        try:
            shared = self._key.exchange(X25519PublicKey.from_public_bytes(sender_key))
        except ValueError:
            raise StreamAuthError("the hello's key is not a usable X25519 key") from None
        key, prefix, expected = _derive(shared, self.token, name, cipher, sender_key,
                                        self.public)
        if not hmac.compare_digest(proof, expected):
            raise StreamAuthError("the hello's proof does not match our offer")
        return RecordOpener(key, prefix, cipher)


def take_offer(
    name: str, token: bytes, receiver_key: bytes, cipher: str
) -> tuple[bytes, RecordSealer]:
    """The sender's side: (what its hello carries after the name, its sealer), for a
    `cipher` stream from `name` to the daemon that offered `token` and
    `receiver_key`.  Raises ValueError if `receiver_key` is not a usable X25519
    key or `cipher` is unknown."""
    if cipher not in _AEADS:
        raise ValueError(f"unknown stream cipher {cipher!r}")
    mine = X25519PrivateKey.generate()
    public = _public_bytes(mine)
    shared = mine.exchange(X25519PublicKey.from_public_bytes(receiver_key))
    key, prefix, proof = _derive(shared, token, name, cipher, public, receiver_key)
    chosen = bytes([STREAM_CIPHERS.index(cipher)])
    return chosen + public + proof, RecordSealer(key, prefix, cipher)
