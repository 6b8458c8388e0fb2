/* The wire codecs of compressed inter-daemon collectives, for float32 buffers.
 *
 * Why C: numpy's bf16 cast plus the in-place rounding takes several passes over
 * the slice, and the fp8 block scaling a dozen (abs, isfinite, max, frexp,
 * ldexp, cast, and again to decode); at network speed that would make the
 * daemon's one event loop CPU-bound (benchmarks/wire_codec.py measures both).
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define EXP_MIN (-140)
#define EXP_MAX 127

static float fp8_values[256];

static inline uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f)
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
static inline uint8_t to_e4m3(float y, float *rounded)
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
    uint32_t is_small = 0u - (uint32_t)(v < 0x3c800000u);  /* all ones or zero */
    *rounded = float_of(((bits_of(small_value) & is_small) | (bits_of(normal_value) & ~is_small))
                        | (u & 0x80000000u));
    return (uint8_t)(((small & is_small) | (normal & ~is_small)) | ((u >> 24) & 0x80u));
}

/* The least k with amax <= 448 * 2^k, clipped. */
static int scale_exponent(float amax)
{
    if (amax == 0.0f)
        return EXP_MIN;
    int e;
    double m = frexp((double)amax / 448.0, &e);
    int k = m == 0.5 ? e - 1 : e;
    return k < EXP_MIN ? EXP_MIN : (k > EXP_MAX ? EXP_MAX : k);
}

static void bf16_encode_run(float *values, uint16_t *codes, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t h = to_bf16(values[i]);
        codes[i] = h;
        values[i] = float_of((uint32_t)h << 16);
    }
}

static void bf16_decode_run(const uint16_t *codes, float *target, Py_ssize_t n, int add)
{
    if (add)
        for (Py_ssize_t i = 0; i < n; i++)
            target[i] += float_of((uint32_t)codes[i] << 16);
    else
        for (Py_ssize_t i = 0; i < n; i++)
            target[i] = float_of((uint32_t)codes[i] << 16);
}

static void fp8_encode_run(float *values, uint8_t *out, Py_ssize_t n)
{
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK;
    uint8_t *codes = out + 4 * blocks;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        /* The largest finite magnitude, compared as bits (the same order for
         * non-negative floats), non-finite counting 0: integer max vectorises. */
        int32_t amax_bits = 0;
        for (Py_ssize_t i = lo; i < hi; i++) {
            int32_t a = (int32_t)(bits_of(values[i]) & 0x7fffffffu);
            a = a < 0x7f800000 ? a : 0;
            amax_bits = a > amax_bits ? a : amax_bits;
        }
        float amax = float_of((uint32_t)amax_bits);
        int k = scale_exponent(amax);
        float scale = ldexpf(1.0f, k);
        /* 2^-k as two float factors (2^140 is no float): each product is exact,
         * but where it lies far below e4m3's smallest step (the code is 0 anyway) */
        float inverse_1 = ldexpf(1.0f, -k / 2), inverse_2 = ldexpf(1.0f, -k - (-k / 2));
        memcpy(out + 4 * b, &scale, 4);
        for (Py_ssize_t i = lo; i < hi; i++) {
            float x = values[i];
            float rounded;
            uint8_t code = to_e4m3(x * inverse_1 * inverse_2, &rounded);
            uint32_t finite = 0u - (uint32_t)((bits_of(x) & 0x7fffffffu) < 0x7f800000u);
            codes[i] = (uint8_t)((code & finite) | (0x7fu & ~finite));
            values[i] = float_of((bits_of(rounded * scale) & finite) | (0x7fc00000u & ~finite));
        }
    }
}

static void fp8_decode_run(const uint8_t *in, float *target, Py_ssize_t n, int add)
{
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK;
    const uint8_t *codes = in + 4 * blocks;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        float scale;
        memcpy(&scale, in + 4 * b, 4);
        if (add)
            for (Py_ssize_t i = lo; i < hi; i++)
                target[i] += fp8_values[codes[i]] * scale;
        else
            for (Py_ssize_t i = lo; i < hi; i++)
                target[i] = fp8_values[codes[i]] * scale;
    }
}

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
    Py_BEGIN_ALLOW_THREADS
    if (fp8)
        fp8_encode_run((float *)values.buf, (uint8_t *)out.buf, values.len / 4);
    else
        bf16_encode_run((float *)values.buf, (uint16_t *)out.buf, values.len / 4);
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
        Py_BEGIN_ALLOW_THREADS
        if (fp8)
            fp8_decode_run((const uint8_t *)payload.buf, (float *)target.buf,
                           target.len / 4, add);
        else
            bf16_decode_run((const uint16_t *)payload.buf, (float *)target.buf,
                            target.len / 4, add);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&payload);
    PyBuffer_Release(&target);
    if (add < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL, encode_doc},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gradsync.daemon.backends._wirecodec",
    "bf16 and block-scaled fp8 wire codecs for float32 (optional; see wire_codec.py).",
    0, methods, NULL, NULL, NULL, NULL,
};

/* The module, once the table of the 256 e4m3fn values is filled. */
PyMODINIT_FUNC PyInit__wirecodec(void)
{
    for (int code = 0; code < 256; code++) {
        int exponent = (code >> 3) & 15, mantissa = code & 7;
        float value;
        if ((code & 0x7f) == 0x7f)
            value = NAN;
        else if (exponent == 0)
            value = ldexpf((float)mantissa, -9);
        else
            value = ldexpf(1.0f + (float)mantissa / 8.0f, exponent - 7);
        fp8_values[code] = code & 0x80 ? -value : value;
    }
    return PyModule_Create(&module);
}
