"""The fast path's compiled publish-and-spin (protocol/_fastpage.c), on a real page.

Each rank of a page is played in turn by this process: the first ranks publish
and find the others missing (WAITING), the last finds everyone and reduces.
Its float reductions must equal numpy's rank-order reduction bit for bit, on
values that round, overflow, underflow and carry NaNs and signed zeros; the
other outcomes (broken page, withdrawn key, differing fingerprint) and bad
arguments are checked too.  The install must have built the module: CI has a
C compiler, and without it the fast path would silently run the slower Python
steps (those are run too: tests/test_fast_path.py, GRADSYNC_FAST_PATH=python).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from conftest import WITHOUT_THE_FASTPAGE_MODULE
from gradsync.protocol import fast_path
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.fast_path import (
    BUSY,
    FAST_REDUCTIONS,
    MISMATCH,
    PUBLISHED,
    REDUCED,
    REFUSED,
    WAITING,
    WITHDRAWN,
    FastPage,
    page_bytes,
)
from gradsync.protocol.reduction import reduce_in_rank_order

try:
    from gradsync.protocol import _fastpage
except ImportError as exc:  # pragma: no cover - reported by the first test
    _fastpage = None
    IMPORT_ERROR: ImportError | None = exc
else:
    IMPORT_ERROR = None

LIMIT = 4096
OpenPage = Callable[..., FastPage]
SPIN_NS = 0  # one look: the tests play every rank in one process


@pytest.fixture
def open_page() -> Iterator[OpenPage]:
    """A factory of formatted fast pages in temporary files, closed afterwards."""
    opened: list[tuple[FastPage, mmap.mmap, int]] = []

    def make(ranks: int, lock_kind: int | None = None) -> FastPage:
        fd, path = tempfile.mkstemp(prefix="gradsync-test-page-")
        os.unlink(path)
        nbytes = page_bytes(ranks, LIMIT)
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        page = FastPage(mapping, fd, ranks, LIMIT)
        page.format(lock_kind)
        opened.append((page, mapping, fd))
        return page

    yield make
    for page, mapping, fd in opened:
        page.close()
        mapping.close()
        os.close(fd)


def publish(page: FastPage, rank: int, key: int, data: np.ndarray, reduction: int,
            codes: int = 7, index: int = 0, reuse_key: int = -1) -> object:
    assert page.compiled is not None
    return page.compiled.publish(rank, index, key, codes, data.size, data, reduction,
                                 SPIN_NS, SPIN_NS, reuse_key)


def test_the_module_was_built_and_agrees_with_the_python_constants() -> None:
    assert _fastpage is not None, (
        f"gradsync.protocol._fastpage was not built ({IMPORT_ERROR}); "
        "install with a C compiler (pip install -e .)"
    )
    assert (_fastpage.REFUSED, _fastpage.WAITING, _fastpage.MISMATCH, _fastpage.REDUCED,
            _fastpage.BUSY) == (REFUSED, WAITING, MISMATCH, REDUCED, BUSY)


def awkward_values(dtype: np.dtype, count: int, seed: int) -> np.ndarray:
    """Values whose sums and products round, with overflow, subnormals, NaN and -0.0."""
    rng = np.random.default_rng(seed)
    info = np.finfo(dtype)
    values = (rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(dtype)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, info.max, -info.max,
                         info.tiny, info.smallest_subnormal, -info.smallest_subnormal,
                         info.eps, 1 / 3], dtype=dtype)
    where = rng.integers(0, count, size=count // 8)
    values[where] = specials[rng.integers(0, len(specials), size=len(where))]
    return values


@pytest.mark.skipif(_fastpage is None, reason="the compiled module was not built")
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize(("dtype", "op"), sorted(FAST_REDUCTIONS, key=str))
def test_a_compiled_reduction_equals_numpys_bit_for_bit(
    open_page: OpenPage, ranks: int, dtype: str, op: ReduceOp
) -> None:
    page = open_page(ranks)
    np_type = np.dtype(dtype)
    count = LIMIT // np_type.itemsize
    reduction = FAST_REDUCTIONS[(dtype, op)]
    for key, size in enumerate((count, 1, count - 3, 0)):
        inputs = [awkward_values(np_type, size, seed=97 * key + rank) for rank in range(ranks)]
        data = [values.copy() for values in inputs]
        for rank in range(ranks - 1):
            assert publish(page, rank, key, data[rank], reduction) == WAITING
        assert publish(page, ranks - 1, key, data[-1], reduction) == REDUCED
        expected = np.empty_like(inputs[0])
        reduce_in_rank_order(expected, inputs, op)
        assert data[-1].tobytes() == expected.tobytes(), (dtype, op, ranks, size)
        assert page.word(ranks - 1, fast_path.DONE) == key
        assert page.word(ranks - 1, fast_path.COMPLETED) == key + 1
        assert page.all_published(key) == [0] * ranks  # what the others see on their look


@pytest.mark.skipif(_fastpage is None, reason="the compiled module was not built")
def test_a_buffer_a_peer_still_reads_is_not_written_until_the_peer_is_done(
    open_page: OpenPage,
) -> None:
    """The buffer last held key 3, read by the peers: while rank 2 has not finished
    key 3, publishing key 5 from it is BUSY and leaves the buffer as it was."""
    page = open_page(3)
    sum_f32 = FAST_REDUCTIONS[("float32", ReduceOp.SUM)]
    for rank in range(3):
        assert publish(page, rank, 3, np.full(4, 1.0, np.float32), sum_f32) in (
            WAITING, REDUCED)
    page.set_word(0, fast_path.DONE, 3)
    page.set_word(1, fast_path.DONE, 3)
    page.set_word(2, fast_path.DONE, 2)  # rank 2 is still reading key 3
    held = page.views(np.dtype(np.float32), 4)[0][0].copy()
    fresh = np.full(4, 9.0, np.float32)
    assert publish(page, 0, 5, fresh, sum_f32, reuse_key=3) == BUSY
    assert page.buffer_key(0, 0) == 3 and page.word(0, fast_path.PUBLISHED) == 3
    assert (page.views(np.dtype(np.float32), 4)[0][0] == held).all()
    page.set_word(2, fast_path.DONE, 3)
    assert publish(page, 0, 5, fresh, sum_f32, reuse_key=3) == WAITING
    assert page.buffer_key(0, 0) == 5


@pytest.mark.skipif(_fastpage is None, reason="the compiled module was not built")
def test_the_callers_reduction_gets_every_ranks_buffer_index(open_page: OpenPage) -> None:
    page = open_page(3)
    data = np.arange(5, dtype=np.int32)
    assert publish(page, 0, 4, data, 0, index=1) == WAITING
    assert publish(page, 1, 4, data, 0, index=0) == WAITING
    assert publish(page, 2, 4, data, 0, index=1) == [1, 0, 1]
    views = page.views(np.dtype(np.int32), 5)
    assert all((views[rank][i] == data).all() for rank, i in enumerate([1, 0, 1]))
    assert page.word(2, fast_path.DONE) == fast_path.NOTHING  # the caller writes it


@pytest.mark.skipif(_fastpage is None, reason="the compiled module was not built")
def test_a_broken_page_or_a_withdrawn_key_refuses_and_publishes_nothing(
    open_page: OpenPage,
) -> None:
    page = open_page(2)
    data = np.ones(4, dtype=np.float32)
    page.set_word(1, WITHDRAWN, 3)
    assert publish(page, 0, 3, data, FAST_REDUCTIONS[("float32", ReduceOp.SUM)]) == REFUSED
    assert page.word(0, PUBLISHED) == fast_path.NOTHING
    assert page.published_index(0, 3) is None
    page.set_broken()
    assert publish(page, 0, 4, data, FAST_REDUCTIONS[("float32", ReduceOp.SUM)]) == REFUSED
    assert page.word(0, PUBLISHED) == fast_path.NOTHING


@pytest.mark.skipif(_fastpage is None, reason="the compiled module was not built")
def test_differing_fingerprints_leave_the_buffers_unreduced(open_page: OpenPage) -> None:
    page = open_page(2)
    sum_f32 = FAST_REDUCTIONS[("float32", ReduceOp.SUM)]
    first, second = np.full(4, 2.0, np.float32), np.full(4, 5.0, np.float32)
    assert publish(page, 0, 0, first, sum_f32, codes=7) == WAITING
    assert publish(page, 1, 0, second, sum_f32, codes=8) == MISMATCH
    assert (second == 5.0).all()
    assert page.word(1, fast_path.DONE) == fast_path.NOTHING


@pytest.mark.skipif(_fastpage is None, reason="the compiled module was not built")
def test_arguments_that_do_not_fit_the_page_are_refused_before_anything_is_written(
    open_page: OpenPage,
) -> None:
    assert _fastpage is not None
    page = open_page(2)
    data = np.ones(4, dtype=np.float32)
    sum_f32 = FAST_REDUCTIONS[("float32", ReduceOp.SUM)]

    def call(rank: int = 0, index: int = 0, values: object = data,
             reduction: int = sum_f32) -> object:
        assert page.compiled is not None
        return page.compiled.publish(rank, index, 1, 7, 4, values, reduction, SPIN_NS, SPIN_NS)

    layout = page.c_layout(fast_path.MUTEX)
    words = np.frombuffer(layout, dtype=np.int64).copy()
    outside = words.copy()
    outside[-4] = len(page.q) + 10  # the last rank's second buffer, beyond the page
    with pytest.raises(ValueError, match="does not fit the page"):
        _fastpage.Page(page.q, outside.tobytes(), page.fd)
    with pytest.raises(ValueError, match="fits no number of ranks"):
        _fastpage.Page(page.q, layout[:-8], page.fd)
    lock_outside = words.copy()
    lock_outside[7] = page.q.nbytes - 8  # the mutex would run past the page's end
    with pytest.raises(ValueError, match="the lock lies outside the page"):
        _fastpage.Page(page.q, lock_outside.tobytes(), page.fd)
    with pytest.raises(ValueError, match="out of range"):
        call(rank=2)
    with pytest.raises(ValueError, match="out of range"):
        call(index=2)
    with pytest.raises(ValueError, match="the page holds"):
        call(values=np.ones(LIMIT // 4 + 1, dtype=np.float32))
    with pytest.raises(ValueError, match="not one of this module's"):
        call(reduction=99)
    with pytest.raises(ValueError, match="not one of this module's"):
        call(values=np.ones(3, dtype=np.int16))  # 6 bytes: no whole float32s
    with pytest.raises(ValueError, match="not C-contiguous"):
        call(values=np.ones(8, dtype=np.float32)[::2])
    read_only = np.ones(4, dtype=np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        call(values=read_only)
    with pytest.raises(TypeError):
        page.compiled.publish(0, 0)
    assert page.word(0, PUBLISHED) == fast_path.NOTHING
    assert page.word(1, PUBLISHED) == fast_path.NOTHING


#: Another process mapping a test page (its descriptor passed down) as a client does.
MAP_PAGE = """
import mmap, os, signal, sys
from gradsync.protocol.fast_path import FastPage
passed, ranks, limit, nbytes = (int(word) for word in sys.argv[1:5])
fd = os.open(f"/proc/self/fd/{passed}", os.O_RDWR)  # an open of its own, as a client's
page = FastPage(mmap.mmap(fd, nbytes), fd, ranks, limit)
"""


def page_process(page: FastPage, code: str, prelude: str = "") -> list[str]:
    """A command that maps `page` in another process (its descriptor passed down) and
    runs `code` (`prelude` before anything is imported)."""
    return [sys.executable, "-c", prelude + MAP_PAGE + textwrap.dedent(code), str(page.fd),
            str(page.ranks), str(page.limit), str(len(page.mapping))]


def tries_the_lock_elsewhere(page: FastPage) -> str:
    """What another process's try at the page's lock gets: "True" or "False".  Taken,
    it unmaps the page still holding it, then exits: the lock must not stay behind."""
    done = subprocess.run(page_process(page, """
        page.check()
        print(page.try_lock())
        page.close()
        page.mapping.close()
    """), pass_fds=(page.fd,), capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(_fastpage is None, reason="the compiled module was not built")
def test_the_page_lock_is_one_across_processes_and_a_dead_holders_passes_on(
    open_page: OpenPage,
) -> None:
    """The page's mutex excludes another process; a holder SIGKILLed inside it does not
    wedge the page: the next taker gets it (as the kernel releases a dead holder's
    flock), and publications go on."""
    page = open_page(2)
    assert page.lock_kind == fast_path.MUTEX
    with page.locked():
        assert tries_the_lock_elsewhere(page) == "False"
    child = subprocess.Popen(page_process(page, """
        page.check()
        page.compiled.lock()
        print("held", flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), signal.SIGKILL)
    """), pass_fds=(page.fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "held\n"
        assert not page.try_lock()  # held by the other process
        child.stdin.write("die\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    assert page.try_lock()  # the dead holder's lock, made consistent
    page.unlock()
    assert tries_the_lock_elsewhere(page) == "True"  # and that process ends holding it
    assert page.try_lock()
    page.unlock()
    sum_f32 = FAST_REDUCTIONS[("float32", ReduceOp.SUM)]
    assert publish(page, 0, 0, np.ones(4, np.float32), sum_f32) == WAITING
    assert publish(page, 1, 0, np.ones(4, np.float32), sum_f32) == REDUCED


@pytest.mark.skipif(_fastpage is None, reason="the compiled module was not built")
def test_a_page_formatted_with_flock_as_its_lock_runs_the_same_steps(
    open_page: OpenPage,
) -> None:
    """A daemon without the compiled module formats its pages with the flock as the
    lock: the compiled publish takes that lock then, and an flock held elsewhere
    (another open of the page) keeps both it and `try_lock` out."""
    page = open_page(2, fast_path.FLOCK)
    assert page.lock_kind == fast_path.FLOCK
    assert tries_the_lock_elsewhere(page) == "True"
    with page.locked():
        assert tries_the_lock_elsewhere(page) == "False"
    other = os.open(f"/proc/self/fd/{page.fd}", os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        assert not page.try_lock()
        fcntl.flock(other, fcntl.LOCK_UN)
    finally:
        os.close(other)
    sum_f32 = FAST_REDUCTIONS[("float32", ReduceOp.SUM)]
    assert publish(page, 0, 0, np.full(4, 2.0, np.float32), sum_f32) == WAITING
    data = np.full(4, 3.0, np.float32)
    assert publish(page, 1, 0, data, sum_f32) == REDUCED
    assert (data == 5.0).all()


def test_without_the_compiled_module_a_mutex_page_is_declined_and_an_flock_page_serves(
    open_page: OpenPage,
) -> None:
    """A client whose install did not build the module cannot take a mutex: it refuses
    such a page, saying why (its FastPath then keeps to the socket); a page with the
    flock as its lock it takes, in Python."""
    code = """
        page.check()
        with page.locked():
            print("locked", page.compiled)
    """
    kinds = [fast_path.FLOCK] + ([fast_path.MUTEX] if _fastpage is not None else [])
    for kind in kinds:
        page = open_page(2, kind)
        done = subprocess.run(page_process(page, code, prelude=WITHOUT_THE_FASTPAGE_MODULE),
                              pass_fds=(page.fd,), capture_output=True, text=True, timeout=60)
        if kind == fast_path.FLOCK:
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == "locked None"
        else:
            assert done.returncode != 0
            assert "needs gradsync.protocol._fastpage" in done.stderr, done.stderr
