/* The wire codecs of compressed inter-daemon collectives, for float32 buffers.
 *
 * Why C: numpy's bf16 cast plus the in-place rounding takes several passes over
 * the slice, and the fp8 block scaling a dozen (abs, isfinite, max, frexp,
 * ldexp, cast, and again to decode); at network speed that would make the
 * daemon's one event loop CPU-bound (benchmarks/compression.py measures both).
 * Here each direction is one pass, written so the compiler vectorises it.
 *
 * The formats and their rules are daemon/backends/wire_codec.py's, bit for bit
 * (tests/test_wire_codec.py compares the two on values that round, overflow,
 * underflow, and carry NaN, infinities and signed zeros):
 *   bf16: round to nearest even; NaN -> sign | 0x7fc0 (as ml_dtypes does).
 *   fp8:  per block of 256 elements a float32 scale 2^k, k the least integer
 *         with amax <= 448 * 2^k (amax: the largest finite magnitude; 0 -> -140),
 *         clipped to [-140, 127]; then e4m3fn codes of x * 2^-k, round to nearest
 *         even, non-finite -> 0x7f.  All scales first, then all codes.
 * encode() also rounds the values in place to what they decode to.
 *
 * Variants.  The kernels are written once, as plain C without libm calls or
 * table look-ups, and compiled once per instruction set: "avx512" (AVX-512
 * F/BW/VL), "avx2" (AVX2, FMA, F16C) and "baseline" (what the build targets:
 * SSE2 on x86-64, NEON on aarch64; the only one where __x86_64__ is not defined,
 * or GRADSYNC_NO_X86 is).  At import the module takes the best the CPU runs
 * (__builtin_cpu_supports), or the one GRADSYNC_CODEC_VARIANT names; variant(),
 * variants() and set_variant() show and change it.  Every variant runs the same
 * integer and float operations in the same order, so all give the same bits:
 * setup.py builds with -ffp-contract=off, as a multiply-add fused into one FMA
 * rounds once where the C rounds twice (tests/test_wire_codec.py compares each
 * variant with numpy).
 */
#ifdef GRADSYNC_KERNELS_ONLY
/* The kernels and variants alone, without the module: for a check built and run
 * on another architecture with no Python there (tests/native/wirecodec_check.c). */
#include <stddef.h>
typedef ptrdiff_t Py_ssize_t;
#else
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 256
#define EXP_MIN (-140)
#define EXP_MAX 127

#if defined(__x86_64__) && !defined(GRADSYNC_NO_X86)
#define X86_VARIANTS 1
#else
#define X86_VARIANTS 0
#endif

/* The kernels' bodies: inlined into each variant's wrappers, and compiled there
 * for the wrapper's instruction set. */
#define BODY static inline __attribute__((always_inline))

BODY uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

BODY float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* 2^e, e in [-149, 127], exactly (as ldexpf(1, e)). */
BODY float pow2f(int e)
{
    return e >= -126 ? float_of((uint32_t)(e + 127) << 23) : float_of(1u << (e + 149));
}

BODY uint16_t to_bf16(float f)
{
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e4m3fn code of a finite y with |y| <= 448, round to nearest even, and in
 * `rounded` the value it stands for.  Branch-free (both roundings computed, one
 * kept) and without a table look-up, so the loop around it vectorises. */
BODY uint8_t to_e4m3(float y, float *rounded)
{
    uint32_t u = bits_of(y);
    uint32_t v = u & 0x7fffffffu;
    /* |y| >= 2^-6: round the 23 mantissa bits to 3; the carry may bump the exponent;
     * then rebias (127 -> 7): (r >> 20) is exponent << 3 | mantissa */
    uint32_t r = v + 0x7ffffu + ((v >> 20) & 1u);
    uint32_t normal = (r >> 20) - (120u << 3);
    float normal_value = float_of(r & 0xfff00000u);
    /* |y| < 2^-6: codes m * 2^-9, m in 0..8 (8 is 2^-6), rounded by the float adder,
     * whose result 2^23 + m has m in its low mantissa bits */
    float shifted = float_of(v) * 512.0f + 8388608.0f;
    uint32_t small = bits_of(shifted) - 0x4b000000u;
    float small_value = (shifted - 8388608.0f) * 0.001953125f;
    /* all ones or zero; a signed compare (v has no sign bit): SSE2 has no unsigned one */
    uint32_t is_small = 0u - (uint32_t)((int32_t)v < 0x3c800000);
    *rounded = float_of(((bits_of(small_value) & is_small) | (bits_of(normal_value) & ~is_small))
                        | (u & 0x80000000u));
    return (uint8_t)(((small & is_small) | (normal & ~is_small)) | ((u >> 24) & 0x80u));
}

/* The value of e4m3fn `code`: exponent e > 0 and mantissa m are float32's bits
 * rebiased (7 -> 127); e = 0 is m * 2^-9; 0x7f and 0xff are NaN (C's NAN, signed). */
BODY float from_e4m3(uint8_t code)
{
    uint32_t c = code & 0x7fu;
    uint32_t normal = (c << 20) + (120u << 23);
    float small = (float)(int32_t)c * 0.001953125f;
    uint32_t is_small = 0u - (uint32_t)(c < 8u);
    uint32_t is_nan = 0u - (uint32_t)(c == 0x7fu);
    uint32_t u = (bits_of(small) & is_small) | (normal & ~is_small);
    u = (u & ~is_nan) | (0x7fc00000u & is_nan);
    return float_of(u | ((uint32_t)(code & 0x80u) << 24));
}

/* The least k with amax <= 448 * 2^k, clipped.  amax = m * 2^e, m in [1, 2) (as a
 * double, where float32's subnormals are normal) and 448 = 1.75 * 2^8: k = e - 8,
 * or e - 7 where m > 1.75. */
BODY int scale_exponent(float amax)
{
    if (amax == 0.0f)
        return EXP_MIN;
    double wide = (double)amax;
    uint64_t d;
    memcpy(&d, &wide, 8);
    int k = (int)(d >> 52) - 1023 - 8 + ((d & 0xfffffffffffffull) > 0xc000000000000ull);
    return k < EXP_MIN ? EXP_MIN : (k > EXP_MAX ? EXP_MAX : k);
}

BODY void bf16_encode_run(float *values, uint16_t *codes, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t h = to_bf16(values[i]);
        codes[i] = h;
        values[i] = float_of((uint32_t)h << 16);
    }
}

BODY void bf16_decode_run(const uint16_t *codes, float *target, Py_ssize_t n, int add)
{
    if (add)
        for (Py_ssize_t i = 0; i < n; i++)
            target[i] += float_of((uint32_t)codes[i] << 16);
    else
        for (Py_ssize_t i = 0; i < n; i++)
            target[i] = float_of((uint32_t)codes[i] << 16);
}

/* One block of `count` <= BLOCK elements: its scale into `scale_out`, its codes. */
BODY void fp8_encode_block(float *values, uint8_t *scale_out, uint8_t *codes, Py_ssize_t count)
{
    /* The largest finite magnitude, compared as bits (the same order for
     * non-negative floats), non-finite counting 0: integer max vectorises. */
    int32_t amax_bits = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int32_t a = (int32_t)(bits_of(values[i]) & 0x7fffffffu);
        a = a < 0x7f800000 ? a : 0;
        amax_bits = a > amax_bits ? a : amax_bits;
    }
    int k = scale_exponent(float_of((uint32_t)amax_bits));
    float scale = pow2f(k);
    /* 2^-k as two float factors (2^140 is no float): each product is exact,
     * but where it lies far below e4m3's smallest step (the code is 0 anyway) */
    float inverse_1 = pow2f(-k / 2), inverse_2 = pow2f(-k - (-k / 2));
    memcpy(scale_out, &scale, 4);
    for (Py_ssize_t i = 0; i < count; i++) {
        float x = values[i];
        float rounded;
        uint8_t code = to_e4m3(x * inverse_1 * inverse_2, &rounded);
        uint32_t finite = 0u - (uint32_t)((int32_t)(bits_of(x) & 0x7fffffffu) < 0x7f800000);
        codes[i] = (uint8_t)((code & finite) | (0x7fu & ~finite));
        values[i] = float_of((bits_of(rounded * scale) & finite) | (0x7fc00000u & ~finite));
    }
}

BODY void fp8_encode_run(float *values, uint8_t *out, Py_ssize_t n)
{
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK, full = n / BLOCK;
    uint8_t *codes = out + 4 * blocks;
    /* whole blocks with a count the compiler knows, so it drops the loops' tails */
    for (Py_ssize_t b = 0; b < full; b++)
        fp8_encode_block(values + b * BLOCK, out + 4 * b, codes + b * BLOCK, BLOCK);
    if (full < blocks)
        fp8_encode_block(values + full * BLOCK, out + 4 * full, codes + full * BLOCK,
                         n - full * BLOCK);
}

BODY void fp8_decode_run(const uint8_t *in, float *target, Py_ssize_t n, int add)
{
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK;
    const uint8_t *codes = in + 4 * blocks;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        float scale;
        memcpy(&scale, in + 4 * b, 4);
        if (add)
            for (Py_ssize_t i = lo; i < hi; i++)
                target[i] += from_e4m3(codes[i]) * scale;
        else
            for (Py_ssize_t i = lo; i < hi; i++)
                target[i] = from_e4m3(codes[i]) * scale;
    }
}

/* One instruction set's kernels. */
typedef struct {
    const char *name;
    int (*runs)(void);  /* whether this CPU (and OS) runs them */
    void (*bf16_encode)(float *, uint16_t *, Py_ssize_t);
    void (*bf16_decode)(const uint16_t *, float *, Py_ssize_t, int);
    void (*fp8_encode)(float *, uint8_t *, Py_ssize_t);
    void (*fp8_decode)(const uint8_t *, float *, Py_ssize_t, int);
} Variant;

/* The kernels compiled with `TARGET` (a function attribute, or nothing). */
#define VARIANT(NAME, TARGET, RUNS)                                                      \
    TARGET static void bf16_encode_##NAME(float *v, uint16_t *c, Py_ssize_t n)          \
    { bf16_encode_run(v, c, n); }                                                      \
    TARGET static void bf16_decode_##NAME(const uint16_t *c, float *t, Py_ssize_t n,    \
                                          int add)                                     \
    { bf16_decode_run(c, t, n, add); }                                                 \
    TARGET static void fp8_encode_##NAME(float *v, uint8_t *o, Py_ssize_t n)            \
    { fp8_encode_run(v, o, n); }                                                       \
    TARGET static void fp8_decode_##NAME(const uint8_t *i, float *t, Py_ssize_t n,      \
                                         int add)                                      \
    { fp8_decode_run(i, t, n, add); }                                                  \
    static const Variant variant_##NAME = {#NAME, RUNS, bf16_encode_##NAME,             \
        bf16_decode_##NAME, fp8_encode_##NAME, fp8_decode_##NAME};

static int always(void) { return 1; }

#if X86_VARIANTS
static int runs_avx2(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c");
}

static int runs_avx512(void)
{
    return runs_avx2() && __builtin_cpu_supports("avx512f")
        && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

VARIANT(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))),
        runs_avx512)
VARIANT(avx2, __attribute__((target("avx2,fma,f16c"))), runs_avx2)
#endif
VARIANT(baseline, , always)

/* Best first. */
static const Variant *const all_variants[] = {
#if X86_VARIANTS
    &variant_avx512,
    &variant_avx2,
#endif
    &variant_baseline,
};
#define VARIANT_COUNT ((Py_ssize_t)(sizeof all_variants / sizeof all_variants[0]))

/* The variant in use: set and read with the GIL held, once per call (a call
 * that has released the GIL finishes with the one it read). */
static const Variant *active = &variant_baseline;

/* The variant called `name` if this CPU runs it, else NULL. */
static const Variant *runnable(const char *name)
{
    for (Py_ssize_t i = 0; i < VARIANT_COUNT; i++)
        if (strcmp(all_variants[i]->name, name) == 0 && all_variants[i]->runs())
            return all_variants[i];
    return NULL;
}

static const Variant *best(void)
{
    for (Py_ssize_t i = 0; i < VARIANT_COUNT; i++)
        if (all_variants[i]->runs())
            return all_variants[i];
    return &variant_baseline;
}

/* "avx512, avx2, baseline": the names of the variants this CPU runs, for errors. */
static const char *runnable_names(void)
{
    static char names[64];
    names[0] = '\0';
    for (Py_ssize_t i = 0; i < VARIANT_COUNT; i++)
        if (all_variants[i]->runs()) {
            if (names[0] != '\0')
                strcat(names, ", ");
            strcat(names, all_variants[i]->name);
        }
    return names;
}

#ifndef GRADSYNC_KERNELS_ONLY
/* The format code and two buffers: float32 values (writable) and bytes of the
 * size the format gives them.  `values_at`: the argument holding the values. */
static int take(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int values_at,
                int bytes_writable, int *fp8, Py_buffer *values, Py_buffer *bytes)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "takes %zd arguments", want);
        return -1;
    }
    long format = PyLong_AsLong(args[0]);
    if (format == -1 && PyErr_Occurred())
        return -1;
    if (format != 0 && format != 1) {
        PyErr_Format(PyExc_ValueError, "format %ld: 0 (bf16) or 1 (fp8)", format);
        return -1;
    }
    *fp8 = (int)format;
    if (PyObject_GetBuffer(args[values_at], values, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    if (PyObject_GetBuffer(args[3 - values_at], bytes,
                           PyBUF_C_CONTIGUOUS | (bytes_writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyBuffer_Release(values);
        return -1;
    }
    Py_ssize_t n = values->len / 4;
    Py_ssize_t expected = *fp8 ? n + 4 * ((n + BLOCK - 1) / BLOCK) : 2 * n;
    if (values->len % 4 == 0 && bytes->len == expected)
        return 0;
    PyErr_Format(PyExc_ValueError, "%zd bytes of float32 values and %zd encoded bytes "
                 "do not fit (%zd expected)", values->len, bytes->len, expected);
    PyBuffer_Release(bytes);
    PyBuffer_Release(values);
    return -1;
}

PyDoc_STRVAR(encode_doc,
"encode(format, values, out): the codes of float32 `values` (format 0: bf16,\n"
"1: fp8) into `out`; the values are rounded to what the codes decode to.");

static PyObject *encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_buffer values, out;
    int fp8;
    if (take(args, nargs, 3, 1, 1, &fp8, &values, &out) < 0)
        return NULL;
    const Variant *kernels = active;
    Py_BEGIN_ALLOW_THREADS
    if (fp8)
        kernels->fp8_encode((float *)values.buf, (uint8_t *)out.buf, values.len / 4);
    else
        kernels->bf16_encode((float *)values.buf, (uint16_t *)out.buf, values.len / 4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&values);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(decode_doc,
"decode(format, payload, target, add): decode into float32 `target`, adding with `add`.");

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_buffer target, payload;
    int fp8;
    if (take(args, nargs, 4, 2, 0, &fp8, &target, &payload) < 0)
        return NULL;
    int add = PyObject_IsTrue(args[3]);
    if (add >= 0) {
        const Variant *kernels = active;
        Py_BEGIN_ALLOW_THREADS
        if (fp8)
            kernels->fp8_decode((const uint8_t *)payload.buf, (float *)target.buf,
                                target.len / 4, add);
        else
            kernels->bf16_decode((const uint16_t *)payload.buf, (float *)target.buf,
                                 target.len / 4, add);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&payload);
    PyBuffer_Release(&target);
    if (add < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(variant_doc, "variant(): the name of the kernels in use.");

static PyObject *variant(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyUnicode_FromString(active->name);
}

PyDoc_STRVAR(variants_doc,
"variants(): the names of the kernels this CPU runs, best first (\"avx512\",\n"
"\"avx2\", \"baseline\"; only \"baseline\" off x86-64).");

static PyObject *variants(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    PyObject *names = PyList_New(0);
    for (Py_ssize_t i = 0; names != NULL && i < VARIANT_COUNT; i++) {
        if (!all_variants[i]->runs())
            continue;
        PyObject *name = PyUnicode_FromString(all_variants[i]->name);
        if (name == NULL || PyList_Append(names, name) < 0)
            Py_CLEAR(names);
        Py_XDECREF(name);
    }
    if (names == NULL)
        return NULL;
    PyObject *tuple = PyList_AsTuple(names);
    Py_DECREF(names);
    return tuple;
}

PyDoc_STRVAR(set_variant_doc,
"set_variant(name): use the kernels `name` (one of variants()) from the next call on;\n"
"ValueError for a name this CPU does not run.");

static PyObject *set_variant(PyObject *self, PyObject *name)
{
    (void)self;
    const char *text = PyUnicode_AsUTF8(name);
    if (text == NULL)
        return NULL;
    const Variant *chosen = runnable(text);
    if (chosen == NULL) {
        PyErr_Format(PyExc_ValueError, "codec variant %R: this CPU runs %s", name,
                     runnable_names());
        return NULL;
    }
    active = chosen;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL, encode_doc},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, decode_doc},
    {"variant", variant, METH_NOARGS, variant_doc},
    {"variants", variants, METH_NOARGS, variants_doc},
    {"set_variant", set_variant, METH_O, set_variant_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gradsync.daemon.backends._wirecodec",
    "bf16 and block-scaled fp8 wire codecs for float32 (optional; see wire_codec.py).",
    0, methods, NULL, NULL, NULL, NULL,
};

/* The module, with the best variant this CPU runs in use, or the one
 * GRADSYNC_CODEC_VARIANT names ("auto" or empty: the best; one this CPU does not
 * run: the best, and a RuntimeWarning). */
PyMODINIT_FUNC PyInit__wirecodec(void)
{
#if X86_VARIANTS
    __builtin_cpu_init();
#endif
    active = best();
    const char *forced = getenv("GRADSYNC_CODEC_VARIANT");
    if (forced != NULL && forced[0] != '\0' && strcmp(forced, "auto") != 0) {
        const Variant *chosen = runnable(forced);
        if (chosen != NULL)
            active = chosen;
        else if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                                  "GRADSYNC_CODEC_VARIANT=%s: this CPU runs %s; using %s",
                                  forced, runnable_names(), active->name) < 0)
            return NULL;
    }
    return PyModule_Create(&module);
}
#endif /* GRADSYNC_KERNELS_ONLY */
