/* The fast path's hot path in C: publish a rank's data on the fast page and
 * wait, spinning, for every rank to publish the same key.
 *
 * Why C: where ranks outnumber cores (4 ranks on 2 cores), the ranks take turns
 * on each core, and every turn runs a rank's own work again with its caches
 * cold.  Measured on the 2-core VM: two C processes hand a core back and forth
 * through sched_yield in 2.5 us a round trip, two Python processes running the
 * same loop in 10 us; and four ranks running the publish-and-wait below in C,
 * with 10 us of Python around each call, take 43 us per 4 KiB allreduce, where
 * the same steps in Python took 90-110 us.  (Sleeping on the futex at once
 * instead of spinning was 2-4x slower: waking a vCPU is slow on a VM.)
 *
 * The rules are protocol/fast_path.py's, step for step the same as the Python
 * version in client/fast_path.py (which runs where this module was not built):
 * data and fingerprint first, then under the page's flock (taken by trying and
 * yielding, not by sleeping: lock_page), unless the page is
 * broken or the key withdrawn, the key, the publication time and the
 * publication word, and a bump of the bell; sleepers are woken after the lock.
 * Then a spin that yields the core at every look, until every rank has
 * published the key (then each rank's buffer index is returned), or the page
 * broke, the key was withdrawn or the spin time is up (the caller goes on
 * waiting in Python, where the deadline and the daemon are watched).
 * Float sums, averages and products of float32 and float64 are reduced here too
 * (the common case: gradients, losses, norms); every other dtype and op, in numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Looks between two readings of the clock (as the Python spin does). */
#define CHECKS_PER_CLOCK 16
/* Tries at the page's lock, yielding between them, before waiting for it asleep. */
#define LOCK_TRIES 64

/* Results other than a list of buffer indices (protocol/fast_path.py names them). */
#define REFUSED (-1)  /* not published: the page is broken or the key withdrawn */
#define WAITING (-2)  /* published; the spin ended before every rank published */
#define MISMATCH (-3) /* every rank published, but some fingerprint differs */
#define BUSY (-4)     /* not published: a peer still reads the buffer (its last key) */
#define REDUCED 1     /* done: the result is in the caller's array, the done words written */

/* The reductions done here (FAST_REDUCTIONS in protocol/fast_path.py); any other
 * dtype or op is reduced by the caller in numpy, given the buffer indices.  These
 * are IEEE adds, multiplies and one division per element, in rank order, as numpy
 * does them: bit for bit the same result (tests/test_fast_path.py compares them). */
enum { BY_CALLER, F32_SUM, F32_AVG, F32_PROD, F64_SUM, F64_AVG, F64_PROD };

/* The layout words, int64 indices into the page, in the order FastPage.c_layout
 * writes them. */
enum {
    L_BROKEN, L_SLEEPERS, L_BELL_BYTE, L_CODES_OFFSET, L_COUNT_OFFSET, L_DATA_BYTE_OFFSET,
    L_LIMIT, L_FIXED
};
/* After the fixed words, per rank: */
enum { R_PUBLISHED, R_PUBLISHED_NS, R_BUFFER_0, R_BUFFER_1, R_WITHDRAWN, R_DONE, R_COMPLETED,
       PER_RANK };

static int64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static inline int64_t load(volatile int64_t *q, int64_t at)
{
    return __atomic_load_n(&q[at], __ATOMIC_ACQUIRE);
}

static inline void store(volatile int64_t *q, int64_t at, int64_t value)
{
    __atomic_store_n(&q[at], value, __ATOMIC_RELEASE);
}

typedef struct {
    volatile int64_t *q;
    const int64_t *layout;
    Py_ssize_t ranks;
    int64_t key;
} Look;

static inline const int64_t *rank_words(const Look *look, Py_ssize_t rank)
{
    return look->layout + L_FIXED + PER_RANK * rank;
}

static int withdrawn_or_broken(const Look *look)
{
    if (load(look->q, look->layout[L_BROKEN]))
        return 1;
    for (Py_ssize_t rank = 0; rank < look->ranks; rank++)
        if (load(look->q, rank_words(look, rank)[R_WITHDRAWN]) == look->key)
            return 1;
    return 0;
}

/* 1 and `indices` filled if every rank published the key, else 0. */
static int all_published(const Look *look, unsigned char *indices)
{
    for (Py_ssize_t rank = 0; rank < look->ranks; rank++) {
        const int64_t *words = rank_words(look, rank);
        if (load(look->q, words[R_PUBLISHED]) < look->key)
            return 0;
        if (load(look->q, words[R_BUFFER_0]) == look->key)
            indices[rank] = 0;
        else if (load(look->q, words[R_BUFFER_1]) == look->key)
            indices[rank] = 1;
        else
            return 0;
    }
    return 1;
}

/* AVX2 where the CPU has it (as numpy's own loops choose at run time), else SSE2. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDEST_VECTORS __attribute__((target_clones("avx2", "default")))
#else
#define WIDEST_VECTORS
#endif

/* What DEFINE_REDUCE's functions do, from a reduction code (0 is the caller's). */
enum { OP_SUM, OP_AVG, OP_PROD };

/* out <- inputs[0] op inputs[1] op ..., left to right; an average divides once at
 * the end (protocol/reduction.py's order, so numpy's results to the bit). */
#define DEFINE_REDUCE(NAME, T)                                                        \
    WIDEST_VECTORS static void NAME(T *restrict out, T *const *inputs, Py_ssize_t ranks, \
                                    size_t count, int op)                             \
    {                                                                                 \
        const T *restrict first = inputs[0];                                          \
        if (ranks == 1) {                                                             \
            memcpy(out, first, count * sizeof(T));                                    \
            return;                                                                   \
        }                                                                             \
        const T *restrict second = inputs[1];                                         \
        if (op == OP_PROD) {                                                          \
            for (size_t i = 0; i < count; i++)                                        \
                out[i] = first[i] * second[i];                                        \
            for (Py_ssize_t rank = 2; rank < ranks; rank++) {                         \
                const T *restrict next = inputs[rank];                                \
                for (size_t i = 0; i < count; i++)                                    \
                    out[i] *= next[i];                                                \
            }                                                                         \
            return;                                                                   \
        }                                                                             \
        for (size_t i = 0; i < count; i++)                                            \
            out[i] = first[i] + second[i];                                            \
        for (Py_ssize_t rank = 2; rank < ranks; rank++) {                             \
            const T *restrict next = inputs[rank];                                    \
            for (size_t i = 0; i < count; i++)                                        \
                out[i] += next[i];                                                    \
        }                                                                             \
        if (op == OP_AVG) {                                                           \
            const T divisor = (T)ranks;                                               \
            for (size_t i = 0; i < count; i++)                                        \
                out[i] /= divisor;                                                    \
        }                                                                             \
    }

DEFINE_REDUCE(reduce_f32, float)
DEFINE_REDUCE(reduce_f64, double)

/* Reduce every rank's published buffer into `out`; 0 if `reduction` is the caller's. */
static int reduce_here(const Look *look, int reduction, void *out, size_t nbytes,
                       const unsigned char *indices, void **inputs)
{
    if (reduction == BY_CALLER)
        return 0;
    for (Py_ssize_t rank = 0; rank < look->ranks; rank++) {
        int64_t at = rank_words(look, rank)[R_BUFFER_0 + indices[rank]];
        inputs[rank] = (char *)look->q + at * 8 + look->layout[L_DATA_BYTE_OFFSET];
    }
    int op = (reduction - 1) % 3;  /* F32_SUM, F32_AVG, F32_PROD, F64_SUM, ...: OP_* */
    if (reduction <= F32_PROD)
        reduce_f32(out, (float *const *)inputs, look->ranks, nbytes / sizeof(float), op);
    else
        reduce_f64(out, (double *const *)inputs, look->ranks, nbytes / sizeof(double), op);
    return 1;
}

/* Take the page's flock.  It is held for a few stores, so a rank that finds it
 * taken (two ranks publishing at once: the common case) tries again after
 * yielding its core instead of sleeping in flock(LOCK_EX): on a VM, being woken
 * from that sleep costs more than the whole collective (2 ranks, 4 KiB: 17.8 us
 * an op with a blocking flock, 7.5 with this; benchmarks/RESULTS.md, "Small
 * collectives").  After LOCK_TRIES tries (a holder that lost its core) it blocks.
 * 0, or -errno. */
static int lock_page(int fd)
{
    for (int tries = 0; tries < LOCK_TRIES; tries++) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0)
            return 0;
        if (errno == EWOULDBLOCK)
            sched_yield();
        else if (errno != EINTR)
            return -errno;
    }
    while (flock(fd, LOCK_EX) != 0)
        if (errno != EINTR)
            return -errno;
    return 0;
}

static int publish_and_spin(const Look *look, int fd, Py_ssize_t me, int index,
                            int64_t codes, int64_t count, void *data, size_t nbytes,
                            int reduction, int64_t spin_ns, int64_t waker_spin_ns,
                            int64_t reuse_key, unsigned char *indices, void **inputs)
{
    volatile int64_t *q = look->q;
    const int64_t *layout = look->layout;
    const int64_t *mine = rank_words(look, me);
    /* The buffer held `reuse_key`, read by the peers: free once each is done with it. */
    for (Py_ssize_t rank = 0; reuse_key >= 0 && rank < look->ranks; rank++)
        if (rank != me && load(q, rank_words(look, rank)[R_DONE]) < reuse_key)
            return BUSY;
    int64_t at = mine[R_BUFFER_0 + index];
    memcpy((char *)q + at * 8 + layout[L_DATA_BYTE_OFFSET], data, nbytes);
    store(q, at + layout[L_CODES_OFFSET], codes);
    store(q, at + layout[L_COUNT_OFFSET], count);

    int locked = lock_page(fd);
    if (locked != 0)
        return locked - 100;
    int refused = withdrawn_or_broken(look);
    if (!refused) {
        store(q, at, look->key);
        store(q, mine[R_PUBLISHED_NS], monotonic_ns());
        store(q, mine[R_PUBLISHED], look->key);
        __atomic_add_fetch((uint32_t *)((char *)q + layout[L_BELL_BYTE]), 1, __ATOMIC_SEQ_CST);
    }
    flock(fd, LOCK_UN);
    if (refused)
        return REFUSED;
    int woke = load(q, layout[L_SLEEPERS]) > 0;
    if (woke)
        syscall(SYS_futex, (char *)q + layout[L_BELL_BYTE], FUTEX_WAKE, INT32_MAX,
                NULL, NULL, 0);

    const int64_t until = monotonic_ns() + (woke ? waker_spin_ns : spin_ns);
    for (;;) {
        for (int i = 0; i < CHECKS_PER_CLOCK; i++) {
            if (all_published(look, indices))
                goto published;
            sched_yield();
        }
        if (withdrawn_or_broken(look) || monotonic_ns() >= until)
            return WAITING;
    }
published:
    for (Py_ssize_t rank = 0; rank < look->ranks; rank++) {
        int64_t other = rank_words(look, rank)[R_BUFFER_0 + indices[rank]];
        if (load(q, other + layout[L_CODES_OFFSET]) != codes ||
            load(q, other + layout[L_COUNT_OFFSET]) != count)
            return MISMATCH;
    }
    if (!reduce_here(look, reduction, data, nbytes, indices, inputs))
        return 0;
    store(q, mine[R_DONE], look->key);
    store(q, mine[R_COMPLETED], load(q, mine[R_COMPLETED]) + 1);
    return REDUCED;
}

PyDoc_STRVAR(publish_doc,
"publish(page, layout, fd, rank, index, key, codes, count, data, reduction,\n"
"        spin_ns, waker_spin_ns, reuse_key=-1) -> list[int] | int\n\n"
"Publish `data` (a writable C-contiguous buffer) as `rank`'s `key` in its\n"
"buffer `index` of the fast page `page` (writable, locked through `fd`), then\n"
"spin until every rank has published `key`.  `layout`: int64 word indices,\n"
"FastPage.c_layout.  If every rank published it with the same fingerprint,\n"
"reduces into `data` and returns REDUCED, or, for a `reduction` of 0 (the\n"
"caller's), returns every rank's buffer index.  Else REFUSED, WAITING or\n"
"MISMATCH (protocol/fast_path.py), or BUSY, without publishing, while a peer\n"
"has not finished `reuse_key` (>= 0: the key the buffer last held, read by peers).");

static PyObject *publish(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 12 && nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "publish() takes 12 or 13 arguments");
        return NULL;
    }
    int fd = (int)PyLong_AsLong(args[2]);
    Py_ssize_t me = PyLong_AsSsize_t(args[3]);
    int index = (int)PyLong_AsLong(args[4]);
    long long key = PyLong_AsLongLong(args[5]);
    long long codes = PyLong_AsLongLong(args[6]);
    long long count = PyLong_AsLongLong(args[7]);
    int reduction = (int)PyLong_AsLong(args[9]);
    long long spin_ns = PyLong_AsLongLong(args[10]);
    long long waker_spin_ns = PyLong_AsLongLong(args[11]);
    long long reuse_key = nargs == 13 ? PyLong_AsLongLong(args[12]) : -1;
    if (PyErr_Occurred())
        return NULL;
    Py_buffer page, layout, data;
    if (PyObject_GetBuffer(args[0], &page, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &layout, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&page);
        return NULL;
    }
    if (PyObject_GetBuffer(args[8], &data, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&layout);
        PyBuffer_Release(&page);
        return NULL;
    }
    PyObject *result = NULL;
    unsigned char *indices = NULL;
    void **inputs = NULL;
    const int64_t *words = (const int64_t *)layout.buf;
    Py_ssize_t nwords = layout.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t ranks = (nwords - L_FIXED) / PER_RANK;
    Py_ssize_t page_words = page.len / 8;
    if (layout.len % (Py_ssize_t)sizeof(int64_t) || ranks <= 0
            || nwords != L_FIXED + PER_RANK * ranks) {
        PyErr_Format(PyExc_ValueError, "a layout of %zd bytes fits no number of ranks",
                     layout.len);
        goto done;
    }
    if ((uintptr_t)page.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "the page must be 8-byte aligned");
        goto done;
    }
    if (me < 0 || me >= ranks || (index != 0 && index != 1)) {
        PyErr_Format(PyExc_ValueError, "rank %zd of %zd, buffer %d: out of range",
                     me, ranks, index);
        goto done;
    }
    /* Every word the spin reads or writes, and the data, must lie inside the page. */
    if (data.len > words[L_LIMIT]) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of data, the page holds %lld",
                     data.len, (long long)words[L_LIMIT]);
        goto done;
    }
    int64_t bell = words[L_BELL_BYTE];
    if (bell < 0 || bell % 4 || bell + 4 > page.len) {
        PyErr_SetString(PyExc_ValueError, "the bell lies outside the page");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nwords; i++) {
        if (i >= L_BELL_BYTE && i < L_FIXED)
            continue;  /* offsets and sizes, checked with the buffers they apply to */
        Py_ssize_t which = (i - L_FIXED) % PER_RANK;
        int is_buffer = i >= L_FIXED && (which == R_BUFFER_0 || which == R_BUFFER_1);
        int64_t at = words[i];
        int fits = at >= 0 && at < page_words;
        if (is_buffer)
            fits = fits && words[L_CODES_OFFSET] >= 0 && words[L_COUNT_OFFSET] >= 0
                   && at + words[L_CODES_OFFSET] < page_words
                   && at + words[L_COUNT_OFFSET] < page_words
                   && words[L_DATA_BYTE_OFFSET] >= 0
                   && at * 8 + words[L_DATA_BYTE_OFFSET] + words[L_LIMIT] <= page.len;
        if (!fits) {
            PyErr_Format(PyExc_ValueError, "layout word %zd (%lld) does not fit the page",
                         i, (long long)at);
            goto done;
        }
    }
    if (reduction < BY_CALLER || reduction > F64_PROD
            || (reduction != BY_CALLER
                && data.len % (reduction <= F32_PROD ? sizeof(float) : sizeof(double)))) {
        PyErr_Format(PyExc_ValueError, "reduction %d of %zd bytes is not one of this module's",
                     reduction, data.len);
        goto done;
    }
    indices = PyMem_Malloc((size_t)ranks);
    inputs = PyMem_Malloc((size_t)ranks * sizeof(void *));
    if (indices == NULL || inputs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Look look = {(volatile int64_t *)page.buf, words, ranks, key};
    int outcome;
    Py_BEGIN_ALLOW_THREADS
    outcome = publish_and_spin(&look, fd, me, index, codes, count, data.buf,
                               (size_t)data.len, reduction, spin_ns, waker_spin_ns,
                               reuse_key, indices, inputs);
    Py_END_ALLOW_THREADS
    if (outcome <= -100) {
        errno = -(outcome + 100);
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (outcome != 0) {  /* REDUCED, or no result to reduce */
        result = PyLong_FromLong(outcome);
        goto done;
    }
    result = PyList_New(ranks);
    if (result == NULL)
        goto done;
    for (Py_ssize_t rank = 0; rank < ranks; rank++)
        PyList_SET_ITEM(result, rank, PyLong_FromLong(indices[rank]));

done:
    PyMem_Free(inputs);
    PyMem_Free(indices);
    PyBuffer_Release(&data);
    PyBuffer_Release(&layout);
    PyBuffer_Release(&page);
    return result;
}

static PyMethodDef methods[] = {
    {"publish", (PyCFunction)(void (*)(void))publish, METH_FASTCALL, publish_doc},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *module)
{
    if (PyModule_AddIntConstant(module, "REFUSED", REFUSED) < 0
            || PyModule_AddIntConstant(module, "WAITING", WAITING) < 0
            || PyModule_AddIntConstant(module, "MISMATCH", MISMATCH) < 0
            || PyModule_AddIntConstant(module, "REDUCED", REDUCED) < 0
            || PyModule_AddIntConstant(module, "BUSY", BUSY) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gradsync.protocol._fastpage",
    .m_doc = "The fast path's publish-and-spin in C (optional; see client/fast_path.py).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__fastpage(void)
{
    return PyModuleDef_Init(&module);
}
