/* A copy whose destination is not read again soon: a checkpoint's bytes going
 * into daemon memory (client/torch/checkpoint.py).
 *
 * An ordinary copy (memcpy, torch's copy_) first reads every destination cache
 * line it is about to overwrite, so a copy of N bytes moves 3N through memory.
 * Non-temporal stores write whole lines without reading them (and leave the
 * caches to the training), so the same copy moves 2N: about twice as fast where
 * memory bandwidth is the limit, which it is for copies larger than the caches.
 * On x86-64 SSE2 is the baseline, so no check of the CPU is needed; elsewhere,
 * and for small copies, this is memcpy.  The GIL is released while copying, so
 * two threads can share one copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL, copy_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gradsync.client._stream_copy",
    .m_doc = "A copy into memory not read again soon, with non-temporal stores "
             "(optional; see client/torch/checkpoint.py).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__stream_copy(void)
{
    return PyModuleDef_Init(&module);
}
