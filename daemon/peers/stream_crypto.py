"""Sealing the data streams of CURVE links: keys agreed over CURVE, AES-256-GCM records.

Why this and not TLS: measured on this project's 2-core machine
(benchmarks/aead.py), AES-256-GCM through `cryptography` seals and opens
1 MiB records at 9-10 GB/s per core into preallocated buffers, while TLS 1.3
through Python's `ssl` (16 KiB records, copies through its buffers) moved
about 1.1 GB/s, and TLS would need certificates pinned to the CURVE keys.
ChaCha20-Poly1305 (3.2-3.6 GB/s here) is only for CPUs without AES-NI.

Key agreement.  The receiving daemon B keeps, per peer A, an *offer*: a
random 16-byte token and an ephemeral X25519 key.  Its answers to A's link
probes (over CURVE ZeroMQ, so encrypted and authenticated both ways) carry
the data port, the token and the offer's public key, to A alone.  A makes a
fresh X25519 key for each stream it opens and derives with HKDF-SHA256 (the
X25519 secret as input, the token as salt, both public keys and A's name as
info) a 256-bit key, a 4-byte nonce prefix and a 16-byte proof.  Its hello
(in the clear) carries its name, its public key and the proof; nothing
secret.  B derives the same and accepts the stream only if the proof matches,
then replaces its offer to A: a hello (or a whole stream) recorded and played
again later does not match the new offer and is refused.  Without the token,
which only ever travelled over CURVE, no one else can derive the key, even
with the public keys; each stream has its own key, dropped with the stream.

Records.  After the hello the stream is a sequence of records: the plaintext
length (4 bytes, big-endian, 1 to `RECORD_BYTES`), the ciphertext, a 16-byte
GCM tag.  The length is the associated data; the nonce is the prefix and a
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
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

#: Plaintext bytes per record, at most (sealing runs at its full rate from 64 KiB on).
RECORD_BYTES = 1024 * 1024
TAG_BYTES = 16
LENGTH = struct.Struct("!I")
#: Bytes a record adds to its plaintext.
RECORD_OVERHEAD = LENGTH.size + TAG_BYTES
KEY_BYTES = 32
PROOF_BYTES = 16
#: What a sealed stream's hello carries after the name: public key, proof.
HELLO_SECRET_BYTES = KEY_BYTES + PROOF_BYTES
_INFO = b"gradsync data stream v1\x00"
_COUNTER = struct.Struct("!Q")


class StreamAuthError(Exception):
    """A record (or a hello's proof) failed authentication."""


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _derive(
    shared: bytes, token: bytes, name: str, sender_key: bytes, receiver_key: bytes
) -> tuple[bytes, bytes, bytes]:
    """(AES key, nonce prefix, proof) of one stream from `name` to the offer's owner."""
    info = _INFO + name.encode() + b"\x00" + sender_key + receiver_key
    okm = HKDF(hashes.SHA256(), KEY_BYTES + 4 + PROOF_BYTES, token, info).derive(shared)
    return okm[:KEY_BYTES], okm[KEY_BYTES : KEY_BYTES + 4], okm[KEY_BYTES + 4 :]


class RecordSealer:
    """Seals one stream's records, numbering them from 0."""

    def __init__(self, key: bytes, prefix: bytes) -> None:
        self._aead = AESGCM(key)
        self._prefix = prefix
        self._count = 0

    def seal_into(self, plain: memoryview, out: memoryview) -> int:
        """Write the record of `plain` (1 to RECORD_BYTES bytes) at the start of
        `out`; returns its size, len(plain) + RECORD_OVERHEAD."""
        size = plain.nbytes
        length = LENGTH.pack(size)
        out[: LENGTH.size] = length
        nonce = self._prefix + _COUNTER.pack(self._count)
        self._count += 1
        self._aead.encrypt_into(nonce, plain, length, out[LENGTH.size : LENGTH.size + size
                                                          + TAG_BYTES])
        return size + RECORD_OVERHEAD


class RecordOpener:
    """Opens one stream's records, in order, numbering them from 0."""

    def __init__(self, key: bytes, prefix: bytes) -> None:
        self._aead = AESGCM(key)
        self._prefix = prefix
        self._count = 0

    def open_into(self, length: bytes, sealed: memoryview, out: memoryview) -> None:
        """Open the next record (`sealed`: ciphertext and tag) into `out` (exactly
        its plaintext size).  Raises StreamAuthError; `out` then holds garbage."""
        nonce = self._prefix + _COUNTER.pack(self._count)
        try:
            self._aead.decrypt_into(nonce, sealed, length, out)
        except InvalidTag:
            raise StreamAuthError(
                f"record {self._count} failed authentication (altered, replayed or out of order)"
            ) from None
        self._count += 1


class Offer:
    """What a receiving daemon offers one peer: a token and an ephemeral key."""

    def __init__(self) -> None:
        self.token = os.urandom(16)
        self._key = X25519PrivateKey.generate()
        #: The public half, advertised with the token over CURVE.
        self.public = _public_bytes(self._key)

    def accept(self, name: str, secret: bytes) -> RecordOpener:
        """The opener of a stream whose hello gave `name` and `secret` (the
        sender's public key and proof); raises StreamAuthError if the proof
        does not match (the sender did not get this offer)."""
        if len(secret) != HELLO_SECRET_BYTES:
            raise StreamAuthError("the hello carries no key and proof")
        sender_key, proof = secret[:KEY_BYTES], secret[KEY_BYTES:]
        try:
            shared = self._key.exchange(X25519PublicKey.from_public_bytes(sender_key))
        except ValueError:
            raise StreamAuthError("the hello's key is not a usable X25519 key") from None
        key, prefix, expected = _derive(shared, self.token, name, sender_key, self.public)
        if not hmac.compare_digest(proof, expected):
            raise StreamAuthError("the hello's proof does not match our offer")
        return RecordOpener(key, prefix)


def take_offer(name: str, token: bytes, receiver_key: bytes) -> tuple[bytes, RecordSealer]:
    """The sender's side: (what its hello carries after the name, its sealer), for a
    stream from `name` to the daemon that offered `token` and `receiver_key`.
    Raises ValueError if `receiver_key` is not a usable X25519 key."""
    mine = X25519PrivateKey.generate()
    public = _public_bytes(mine)
    shared = mine.exchange(X25519PublicKey.from_public_bytes(receiver_key))
    key, prefix, proof = _derive(shared, token, name, public, receiver_key)
    return public + proof, RecordSealer(key, prefix)
