"""The checkpoint writer's compiled copy (client/_stream_copy.c).

It must give the same bytes as any copy, for every length and alignment (the
streaming loop, its unaligned head and its tail, and the small copies that stay
memcpy), refuse what it cannot do safely, and be what a save uses.  The install
must have built it: CI has a C compiler, and without it a checkpoint save would
silently copy with torch, at about half the speed.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from gradsync.client import _stream_copy

STREAMING = 256 * 1024  # the C module's threshold: at and above it, the streaming loop


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 63, 64, 65, 4095, STREAMING - 1,
                                    STREAMING, STREAMING + 1, 3 * 2**20 + 13])
@pytest.mark.parametrize("offset", [0, 1, 8, 15])
def test_the_copy_gives_the_same_bytes_at_any_length_and_alignment(
    length: int, offset: int
) -> None:
    rng = np.random.default_rng(length * 16 + offset)
    source = rng.integers(0, 256, length + 32, dtype=np.uint8)[offset:offset + length]
    with mmap.mmap(-1, length + 64) as mapping:  # shared memory, as a daemon segment is
        target = np.frombuffer(mapping, dtype=np.uint8)
        target[:] = 0xA5
        _stream_copy.copy(target[offset + 3:offset + 3 + length], source)
        assert np.array_equal(target[offset + 3:offset + 3 + length], source)
        # Not a byte before or after the destination changed.
        assert (target[:offset + 3] == 0xA5).all()
        assert (target[offset + 3 + length:] == 0xA5).all()
        del target


def test_the_copy_refuses_other_lengths_read_only_and_strided_buffers() -> None:
    source = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="destination holds 32 bytes, the source 64"):
        _stream_copy.copy(np.zeros(32, np.uint8), source)
    with pytest.raises((BufferError, TypeError)):
        _stream_copy.copy(bytes(64), source)  # not writable
    with pytest.raises((BufferError, TypeError, ValueError)):
        _stream_copy.copy(np.zeros(128, np.uint8)[::2], source)  # not contiguous
    with pytest.raises(TypeError):
        _stream_copy.copy(np.zeros(64, np.uint8))  # type: ignore[call-arg]


def test_a_checkpoint_save_copies_with_it() -> None:
    torch = pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")
    from gradsync.client.torch import checkpoint

    assert checkpoint._stream_copy is _stream_copy
    source = torch.arange(STREAMING * 3, dtype=torch.int32).view(torch.uint8)
    target = torch.zeros_like(source)
    checkpoint._copy([(target, source)])  # cut in two halves, one on the helper thread
    assert torch.equal(target, source)
