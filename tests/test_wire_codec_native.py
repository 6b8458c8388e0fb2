"""The wire codecs' C kernels built without Python (tests/native/wirecodec_check.c):
every variant this machine runs gives numpy's bits, and so does the aarch64 build
(its baseline variant, NEON there) run under qemu-user.

The check program encodes and decodes one fixed set of values (NaN, infinities,
signed zeros, subnormals, overflow, an all-zero and an all-equal block, random
bit patterns of every exponent) with each variant and prints an FNV-1a hash of
every buffer it wrote; the same steps on the numpy reference
(daemon/backends/wire_codec.py with the C module set aside) give the expected
hash here.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gradsync.daemon.backends import wire_codec

CHECK = Path(__file__).parent / "native" / "wirecodec_check.c"
#: As setup.py builds the module (no fused multiply-adds), and strict.
FLAGS = ["-O3", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror"]
BLOCK = 256
COUNT = 4 * BLOCK + 77
SPECIAL = [0x7FC00000, 0xFFC00001, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
           0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x43E00000,
           0x43E80000, 0xC3F00000, 0x3B800000, 0x00800000]
MASK64 = (1 << 64) - 1


def values() -> np.ndarray:
    """The check program's `fill`, bit for bit."""
    bits = np.empty(COUNT, np.uint32)
    state = 0x9E3779B97F4A7C15
    for i in range(COUNT):
        state ^= (state << 13) & MASK64
        state ^= state >> 7
        state ^= (state << 17) & MASK64
        word = (state >> 16) & 0xFFFFFFFF
        if i < len(SPECIAL):
            word = SPECIAL[i]
        elif i // BLOCK == 2:
            word = 0
        elif i // BLOCK == 3:
            word = 0x40490FDB
        elif i % 3:
            word = (word & 0x807FFFFF) | ((100 + state % 60) << 23)
        bits[i] = word
    return bits.view(np.float32)


def fnv(data: bytes, value: int) -> int:
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) & MASK64
    return value


@pytest.fixture
def numpy_reference() -> Iterator[None]:
    compiled = wire_codec._wirecodec
    wire_codec._wirecodec = None
    try:
        yield
    finally:
        wire_codec._wirecodec = compiled


def reference_hash() -> str:
    """The check program's steps on the numpy reference codecs."""
    value = 0xCBF29CE484222325
    for name in ("bf16", "fp8"):
        codec = wire_codec.CODECS[name]
        rounded = values().copy()
        with np.errstate(invalid="ignore", over="ignore"):
            payload = bytes(codec.encode(rounded))
        value = fnv(payload, fnv(rounded.tobytes(), value))
        decoded = np.zeros(COUNT, np.float32)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinities, on purpose
            codec.decode_into(payload, decoded, add=False)
            codec.decode_into(payload, decoded, add=True)
        value = fnv(decoded.tobytes(), value)
    return f"{value:016x}"


def hashes(output: str) -> dict[str, str]:
    """{variant: hash} from the check program's lines."""
    return {words[1]: words[2] for words in (line.split() for line in output.splitlines())
            if words and words[0] == "variant"}


def build(compiler: str, binary: Path, *extra: str) -> None:
    built = subprocess.run([compiler, *FLAGS, *extra, "-o", str(binary), str(CHECK)],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr


def test_every_variant_built_here_gives_numpys_bits(
    tmp_path: Path, numpy_reference: None
) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    build(compiler, tmp_path / "check")
    ran = subprocess.run([str(tmp_path / "check")], capture_output=True, text=True,
                         timeout=60, check=True)
    found = hashes(ran.stdout)
    assert "baseline" in found, ran.stdout
    expected = reference_hash()
    assert found == dict.fromkeys(found, expected), (ran.stdout, expected)


def test_the_aarch64_build_gives_the_same_bits(tmp_path: Path, numpy_reference: None) -> None:
    compiler, emulator = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if compiler is None or emulator is None:
        pytest.skip("needs gcc-aarch64-linux-gnu and qemu-user (apt-get install both)")
    build(compiler, tmp_path / "check-aarch64", "-static")
    ran = subprocess.run([emulator, str(tmp_path / "check-aarch64")], capture_output=True,
                         text=True, timeout=120, check=True)
    assert "best baseline of baseline" in ran.stdout, ran.stdout  # no x86 variants there
    assert hashes(ran.stdout) == {"baseline": reference_hash()}, ran.stdout
