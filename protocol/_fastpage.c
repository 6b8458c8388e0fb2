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
 * data and fingerprint first, then under the page's lock (taken by trying and
 * yielding, not by sleeping: lock_page), unless the page is
 * broken or the key withdrawn, the key, the publication time and the
 * publication word, and a bump of the bell; sleepers are woken after the lock.
 * The lock is a robust process-shared mutex in the page's header (its owner's
 * death hands it to the next taker, as the kernel releases an flock), or, on a
 * page whose daemon had no compiled module, the page's flock.  A Page object
 * keeps the page and its layout, checked once, between calls.
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
#include <pthread.h>
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
    L_LIMIT, L_LOCK_BYTE, L_FIXED
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

/* The page's lock: a robust process-shared mutex in the page, or (mutex NULL) the
 * page's flock, on a page formatted by a daemon without this module. */
typedef struct {
    pthread_mutex_t *mutex;
    int fd;
} PageLock;

/* One try: 1 taken, 0 held by another, or -errno.  A mutex whose owner died is
 * taken and made consistent: the words it guards are single stores, each valid
 * alone, so the page is usable as the owner left it (as with an flock the
 * kernel released). */
static int try_lock_once(const PageLock *lock)
{
    if (lock->mutex == NULL) {
        if (flock(lock->fd, LOCK_EX | LOCK_NB) == 0)
            return 1;
        return errno == EWOULDBLOCK || errno == EINTR ? 0 : -errno;
    }
    int failed = pthread_mutex_trylock(lock->mutex);
    if (failed == EOWNERDEAD)
        failed = pthread_mutex_consistent(lock->mutex);
    if (failed == 0)
        return 1;
    return failed == EBUSY ? 0 : -failed;
}

/* Take the page's lock.  It is held for a few stores, so a rank that finds it
 * taken (two ranks publishing at once: the common case) tries again after
 * yielding its core instead of sleeping: on a VM, being woken from that sleep
 * costs more than the whole collective (2 ranks, 4 KiB: 17.8 us an op with a
 * blocking flock, 7.5 with this; benchmarks/RESULTS.md, "Small collectives").
 * After LOCK_TRIES tries (a holder that lost its core) it blocks.  0, or -errno. */
static int lock_page(const PageLock *lock)
{
    for (int tries = 0; tries < LOCK_TRIES; tries++) {
        int taken = try_lock_once(lock);
        if (taken != 0)
            return taken < 0 ? taken : 0;
        sched_yield();
    }
    if (lock->mutex == NULL) {
        while (flock(lock->fd, LOCK_EX) != 0)
            if (errno != EINTR)
                return -errno;
        return 0;
    }
    int failed = pthread_mutex_lock(lock->mutex);
    if (failed == EOWNERDEAD)
        failed = pthread_mutex_consistent(lock->mutex);
    return -failed;
}

static void unlock_page(const PageLock *lock)
{
    if (lock->mutex == NULL)
        flock(lock->fd, LOCK_UN);
    else
        pthread_mutex_unlock(lock->mutex);
}

static int publish_and_spin(const Look *look, const PageLock *lock, Py_ssize_t me, int index,
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

    int locked = lock_page(lock);
    if (locked != 0)
        return locked - 100;
    int refused = withdrawn_or_broken(look);
    if (!refused) {
        store(q, at, look->key);
        store(q, mine[R_PUBLISHED_NS], monotonic_ns());
        store(q, mine[R_PUBLISHED], look->key);
        __atomic_add_fetch((uint32_t *)((char *)q + layout[L_BELL_BYTE]), 1, __ATOMIC_SEQ_CST);
    }
    unlock_page(lock);
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

/* A mapped fast page and its layout, checked once: what every call works on. */
typedef struct {
    PyObject_HEAD
    Py_buffer page;          /* held while open; page.obj is NULL once closed */
    int64_t *layout;         /* a copy of the layout words */
    Py_ssize_t ranks;
    PageLock lock;
    pid_t held_by;           /* the process that took it through lock/try_lock, or 0 */
} PageObject;

/* Ranks whose per-call scratch (buffer indices, input pointers) lives on the stack. */
#define STACK_RANKS 64

/* The layout's words, each checked to lie inside the page; NULL and an error if not. */
static int64_t *checked_layout(const Py_buffer *page, const Py_buffer *layout,
                               Py_ssize_t *ranks_out)
{
    const int64_t *words = (const int64_t *)layout->buf;
    Py_ssize_t nwords = layout->len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t ranks = (nwords - L_FIXED) / PER_RANK;
    Py_ssize_t page_words = page->len / 8;
    if (layout->len % (Py_ssize_t)sizeof(int64_t) || ranks <= 0
            || nwords != L_FIXED + PER_RANK * ranks) {
        PyErr_Format(PyExc_ValueError, "a layout of %zd bytes fits no number of ranks",
                     layout->len);
        return NULL;
    }
    if ((uintptr_t)page->buf % 8) {
        PyErr_SetString(PyExc_ValueError, "the page must be 8-byte aligned");
        return NULL;
    }
    int64_t bell = words[L_BELL_BYTE];
    if (bell < 0 || bell % 4 || bell + 4 > page->len) {
        PyErr_SetString(PyExc_ValueError, "the bell lies outside the page");
        return NULL;
    }
    int64_t lock = words[L_LOCK_BYTE];
    if (lock != -1 && (lock < 0 || lock % 8
                       || lock + (int64_t)sizeof(pthread_mutex_t) > page->len)) {
        PyErr_SetString(PyExc_ValueError, "the lock lies outside the page");
        return NULL;
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
                   && words[L_DATA_BYTE_OFFSET] >= 0 && words[L_LIMIT] >= 0
                   && at * 8 + words[L_DATA_BYTE_OFFSET] + words[L_LIMIT] <= page->len;
        if (!fits) {
            PyErr_Format(PyExc_ValueError, "layout word %zd (%lld) does not fit the page",
                         i, (long long)at);
            return NULL;
        }
    }
    int64_t *copy = PyMem_Malloc((size_t)layout->len);
    if (copy == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(copy, words, (size_t)layout->len);
    *ranks_out = ranks;
    return copy;
}

static void page_release(PageObject *self)
{
    /* A robust mutex passes on when its holder dies, but only while the page is still
     * mapped then: let go of it before the mapping can go (not in a forked child, which
     * holds nothing; and an flock goes with its descriptor). */
    if (self->held_by == getpid() && self->lock.mutex != NULL && self->page.obj != NULL)
        unlock_page(&self->lock);
    self->held_by = 0;
    PyMem_Free(self->layout);
    self->layout = NULL;
    if (self->page.obj != NULL)
        PyBuffer_Release(&self->page);
}

static int page_init(PageObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"page", "layout", "fd", NULL};
    PyObject *page_obj, *layout_obj;
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOi:Page", names, &page_obj, &layout_obj,
                                     &fd))
        return -1;
    page_release(self);
    Py_buffer layout;
    if (PyObject_GetBuffer(page_obj, &self->page, PyBUF_WRITABLE) < 0)
        return -1;
    if (PyObject_GetBuffer(layout_obj, &layout, PyBUF_SIMPLE) < 0) {
        page_release(self);
        return -1;
    }
    self->layout = checked_layout(&self->page, &layout, &self->ranks);
    PyBuffer_Release(&layout);
    if (self->layout == NULL) {
        page_release(self);
        return -1;
    }
    int64_t lock = self->layout[L_LOCK_BYTE];
    self->lock.mutex = lock < 0 ? NULL : (pthread_mutex_t *)((char *)self->page.buf + lock);
    self->lock.fd = fd;
    return 0;
}

static void page_dealloc(PageObject *self)
{
    page_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int page_open(const PageObject *self)
{
    if (self->page.obj == NULL) {
        PyErr_SetString(PyExc_ValueError, "the fast page is closed");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(publish_doc,
"publish(rank, index, key, codes, count, data, reduction, spin_ns, waker_spin_ns,\n"
"        reuse_key=-1) -> list[int] | int\n\n"
"Publish `data` (a writable C-contiguous buffer) as `rank`'s `key` in its\n"
"buffer `index`, then spin until every rank has published `key`.  If every\n"
"rank published it with the same fingerprint (`codes`, `count`), reduces into\n"
"`data` and returns REDUCED, or, for a `reduction` of 0 (the caller's), returns\n"
"every rank's buffer index.  Else REFUSED, WAITING or MISMATCH\n"
"(protocol/fast_path.py), or BUSY, without publishing, while a peer has not\n"
"finished `reuse_key` (>= 0: the key the buffer last held, read by peers).");

static PyObject *page_publish(PageObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "publish() takes 9 or 10 arguments");
        return NULL;
    }
    if (!page_open(self))
        return NULL;
    Py_ssize_t me = PyLong_AsSsize_t(args[0]);
    int index = (int)PyLong_AsLong(args[1]);
    long long key = PyLong_AsLongLong(args[2]);
    long long codes = PyLong_AsLongLong(args[3]);
    long long count = PyLong_AsLongLong(args[4]);
    int reduction = (int)PyLong_AsLong(args[6]);
    long long spin_ns = PyLong_AsLongLong(args[7]);
    long long waker_spin_ns = PyLong_AsLongLong(args[8]);
    long long reuse_key = nargs == 10 ? PyLong_AsLongLong(args[9]) : -1;
    if (PyErr_Occurred())
        return NULL;
    if (me < 0 || me >= self->ranks || (index != 0 && index != 1)) {
        PyErr_Format(PyExc_ValueError, "rank %zd of %zd, buffer %d: out of range",
                     me, self->ranks, index);
        return NULL;
    }
    Py_buffer data;
    if (PyObject_GetBuffer(args[5], &data, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *result = NULL;
    unsigned char stack_indices[STACK_RANKS];
    void *stack_inputs[STACK_RANKS];
    unsigned char *indices = stack_indices;
    void **inputs = stack_inputs;
    if (data.len > self->layout[L_LIMIT]) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of data, the page holds %lld",
                     data.len, (long long)self->layout[L_LIMIT]);
        goto done;
    }
    if (reduction < BY_CALLER || reduction > F64_PROD
            || (reduction != BY_CALLER
                && data.len % (reduction <= F32_PROD ? sizeof(float) : sizeof(double)))) {
        PyErr_Format(PyExc_ValueError, "reduction %d of %zd bytes is not one of this module's",
                     reduction, data.len);
        goto done;
    }
    if (self->ranks > STACK_RANKS) {
        indices = PyMem_Malloc((size_t)self->ranks);
        inputs = PyMem_Malloc((size_t)self->ranks * sizeof(void *));
        if (indices == NULL || inputs == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Look look = {(volatile int64_t *)self->page.buf, self->layout, self->ranks, key};
    int outcome;
    Py_BEGIN_ALLOW_THREADS
    outcome = publish_and_spin(&look, &self->lock, me, index, codes, count, data.buf,
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
    result = PyList_New(self->ranks);
    if (result == NULL)
        goto done;
    for (Py_ssize_t rank = 0; rank < self->ranks; rank++)
        PyList_SET_ITEM(result, rank, PyLong_FromLong(indices[rank]));

done:
    if (indices != stack_indices)
        PyMem_Free(indices);
    if (inputs != stack_inputs)
        PyMem_Free(inputs);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *errno_error(int failed)
{
    errno = failed;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *page_lock(PageObject *self, PyObject *unused)
{
    (void)unused;
    if (!page_open(self))
        return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = lock_page(&self->lock);
    Py_END_ALLOW_THREADS
    if (failed != 0)
        return errno_error(-failed);
    self->held_by = getpid();
    Py_RETURN_NONE;
}

static PyObject *page_try_lock(PageObject *self, PyObject *unused)
{
    (void)unused;
    if (!page_open(self))
        return NULL;
    int taken = try_lock_once(&self->lock);
    if (taken < 0)
        return errno_error(-taken);
    if (taken)
        self->held_by = getpid();
    return PyBool_FromLong(taken);
}

static PyObject *page_unlock(PageObject *self, PyObject *unused)
{
    (void)unused;
    if (!page_open(self))
        return NULL;
    unlock_page(&self->lock);
    self->held_by = 0;
    Py_RETURN_NONE;
}

static PyObject *page_init_lock(PageObject *self, PyObject *unused)
{
    (void)unused;
    if (!page_open(self))
        return NULL;
    if (self->lock.mutex == NULL) {
        PyErr_SetString(PyExc_ValueError, "this page's layout has no mutex (its lock is flock)");
        return NULL;
    }
    pthread_mutexattr_t attributes;
    int failed = pthread_mutexattr_init(&attributes);
    if (failed == 0) {
        failed = pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED);
        if (failed == 0)
            failed = pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST);
        if (failed == 0)
            failed = pthread_mutex_init(self->lock.mutex, &attributes);
        pthread_mutexattr_destroy(&attributes);
    }
    if (failed != 0)
        return errno_error(failed);
    Py_RETURN_NONE;
}

static PyObject *page_close(PageObject *self, PyObject *unused)
{
    (void)unused;
    page_release(self);
    Py_RETURN_NONE;
}

static PyMethodDef page_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))page_publish, METH_FASTCALL, publish_doc},
    {"lock", (PyCFunction)page_lock, METH_NOARGS,
     "Take the page's lock (tries, yielding, then waits with the GIL released)."},
    {"try_lock", (PyCFunction)page_try_lock, METH_NOARGS,
     "Take the page's lock if it is free: whether it was taken."},
    {"unlock", (PyCFunction)page_unlock, METH_NOARGS, "Release the page's lock."},
    {"init_lock", (PyCFunction)page_init_lock, METH_NOARGS,
     "Write a fresh robust process-shared mutex (the daemon, formatting the page)."},
    {"close", (PyCFunction)page_close, METH_NOARGS,
     "Let go of the page (before its mapping closes), and of its lock if held here;\n"
     "later calls raise ValueError."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(page_doc,
"Page(page, layout, fd)\n\n"
"A fast page (`page`: its writable mapping) and its layout (int64 words,\n"
"FastPage.c_layout), checked once; `fd`: the page's descriptor, whose flock is\n"
"the lock where the layout has no mutex.");

static PyTypeObject PageType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gradsync.protocol._fastpage.Page",
    .tp_basicsize = sizeof(PageObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = page_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)page_init,
    .tp_dealloc = (destructor)page_dealloc,
    .tp_methods = page_methods,
};

static int exec_module(PyObject *module)
{
    if (PyType_Ready(&PageType) < 0)
        return -1;
    Py_INCREF(&PageType);
    if (PyModule_AddObject(module, "Page", (PyObject *)&PageType) < 0) {
        Py_DECREF(&PageType);
        return -1;
    }
    if (PyModule_AddIntConstant(module, "REFUSED", REFUSED) < 0
            || PyModule_AddIntConstant(module, "WAITING", WAITING) < 0
            || PyModule_AddIntConstant(module, "MISMATCH", MISMATCH) < 0
            || PyModule_AddIntConstant(module, "REDUCED", REDUCED) < 0
            || PyModule_AddIntConstant(module, "BUSY", BUSY) < 0
            || PyModule_AddIntConstant(module, "MUTEX_BYTES", sizeof(pthread_mutex_t)) < 0)
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
    .m_doc = "The fast path's publish-and-spin and page lock in C (optional; see "
             "client/fast_path.py).",
    .m_size = 0,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__fastpage(void)
{
    return PyModuleDef_Init(&module);
}
