/* The checkpoint writer's work on memory (client/checkpoints.py,
 * client/torch/checkpoint.py), with the GIL released so that training goes on.
 *
 * copy: a save's bytes into the daemon's segment.  An ordinary copy (memcpy,
 * torch's copy_) first reads every destination cache line it is about to
 * overwrite, so a copy of N bytes moves 3N through memory.  Non-temporal stores
 * write whole lines without reading them (and leave the caches to the
 * training), so the same copy moves 2N: about twice as fast where memory
 * bandwidth is the limit, which it is for copies larger than the caches.  On
 * x86-64 SSE2 is the baseline, so no check of the CPU is needed; elsewhere, and
 * for small copies, this is memcpy.
 *
 * populate, drop_pages: filling a mapping's page tables before a save writes
 * it, and emptying them before it is unmapped, a step at a time.  Python's
 * mmap(MAP_POPULATE) keeps the GIL for the whole population (about 40 ms per
 * 100 MiB: every other thread of the trainer stops), and one munmap of a
 * populated mapping holds the process's memory map for as long (every other
 * mmap, munmap and fault waits); madvise in steps of a few MiB does neither.
 * Populating takes read faults, as MAP_POPULATE does on a shared mapping: they
 * map a segment's pages writable (tmpfs keeps no dirty state to track) and
 * several at a time, 2.5x faster than write faults.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* Below this a copy stays in the caches anyway: memcpy. */
#define STREAMING_BYTES (256 * 1024)

static void copy_streaming(char *dst, const char *src, size_t n)
{
#if defined(__x86_64__)
    if (n >= STREAMING_BYTES) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        _mm_sfence(); /* the streamed stores are seen before anything after the copy */
        memcpy(dst + i, src + i, n - i);
        return;
    }
#endif
    memcpy(dst, src, n);
}

PyDoc_STRVAR(copy_doc,
"copy(destination, source, /)\n--\n\n"
"Copy the bytes of `source` into `destination` (writable, the same length; both\n"
"C-contiguous buffers), with stores that bypass the caches where it is large.");

static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "copy() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: the destination holds %zd bytes, the source %zd",
                     dst.len, src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_streaming((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* madvise(advice) over the mapping `args[0]` (a writable buffer starting on a
 * page), `args[1]` bytes at a time, without the GIL.  0, or the errno of the first
 * step that failed, in *failed; -1 with an exception set for bad arguments. */
static int advise_in_steps(PyObject *const *args, Py_ssize_t nargs, const char *what,
                           int advice, int *failed)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 2 arguments (%zd given)", what, nargs);
        return -1;
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[1]);
    if (step == -1 && PyErr_Occurred())
        return -1;
    long page = sysconf(_SC_PAGESIZE);
    if (step <= 0 || step % page != 0) {
        PyErr_Format(PyExc_ValueError, "%s: the step must be a positive multiple of %ld "
                     "bytes, got %zd", what, page, step);
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if ((uintptr_t)view.buf % (uintptr_t)page != 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "%s: the buffer does not start on a page", what);
        return -1;
    }
    char *start = (char *)view.buf;
    size_t length = (size_t)view.len;
    *failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t done = 0; done < length; done += (size_t)step) {
        size_t part = length - done < (size_t)step ? length - done : (size_t)step;
        if (madvise(start + done, part, advice) != 0) {
            *failed = errno;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return 0;
}

PyDoc_STRVAR(populate_doc,
"populate(mapping, step, /)\n--\n\n"
"Fill the page tables of a writable shared mapping (as MAP_POPULATE would), `step`\n"
"bytes at a time, without the GIL.  False where the kernel cannot (before Linux\n"
"5.14): the caller maps with MAP_POPULATE instead.  A step that fails otherwise\n"
"(the segment's pages are not all there) ends it: population only saves time.");

static PyObject *populate(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int failed;
    if (advise_in_steps(args, nargs, "populate", MADV_POPULATE_READ, &failed) < 0)
        return NULL;
    return PyBool_FromLong(failed != EINVAL);
}

PyDoc_STRVAR(drop_pages_doc,
"drop_pages(mapping, step, /)\n--\n\n"
"Empty the page tables of a shared mapping (MADV_DONTNEED: the segment keeps its\n"
"bytes), `step` bytes at a time, without the GIL, so that unmapping it is quick.");

static PyObject *drop_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int failed;
    if (advise_in_steps(args, nargs, "drop_pages", MADV_DONTNEED, &failed) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL, copy_doc},
    {"populate", (PyCFunction)(void (*)(void))populate, METH_FASTCALL, populate_doc},
    {"drop_pages", (PyCFunction)(void (*)(void))drop_pages, METH_FASTCALL, drop_pages_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gradsync.client._checkpoint_memory",
    .m_doc = "The checkpoint writer's copy and page tables, without the GIL "
             "(optional; see client/checkpoints.py).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__checkpoint_memory(void)
{
    return PyModuleDef_Init(&module);
}
