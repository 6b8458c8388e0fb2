/* The wire codecs' kernels on any architecture, without Python: every variant
 * this CPU runs encodes and decodes the same values, and prints one line of
 * FNV-1a hashes per variant.  tests/test_wire_codec_native.py builds it for this
 * machine and, where a cross compiler and qemu-user exist, for aarch64 (the
 * baseline variant, NEON there), and asserts the lines equal: the codes are the
 * same bits on every architecture and instruction set (tests/test_wire_codec.py
 * ties the x86 variants to the numpy reference). */
#define GRADSYNC_KERNELS_ONLY 1
#include "../../daemon/backends/_wirecodec.c"

#include <stdio.h>

#define COUNT (4 * BLOCK + 77) /* whole blocks and a ragged last one */

static uint64_t fnv(const void *data, size_t nbytes, uint64_t hash)
{
    const uint8_t *bytes = data;
    for (size_t i = 0; i < nbytes; i++)
        hash = (hash ^ bytes[i]) * 0x100000001b3ULL;
    return hash;
}

/* Values that round, overflow, underflow and carry NaN, infinities, signed
 * zeros and subnormals; block 2 all zero, block 3 all equal; the rest random
 * bit patterns of every exponent (xorshift, fixed seed). */
static void fill(float *values)
{
    static const uint32_t special[] = {
        0x7fc00000u, 0xffc00001u, 0x7f800000u, 0xff800000u, 0x00000000u, 0x80000000u,
        0x00000001u, 0x807fffffu, 0x7f7fffffu, 0x3f808000u, 0x3f818000u, 0x43e00000u,
        0x43e80000u, 0xc3f00000u, 0x3b800000u, 0x00800000u};
    uint64_t state = 0x9e3779b97f4a7c15ULL;
    for (Py_ssize_t i = 0; i < COUNT; i++) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        uint32_t bits = (uint32_t)(state >> 16);
        if (i < (Py_ssize_t)(sizeof special / sizeof special[0]))
            bits = special[i];
        else if (i / BLOCK == 2)
            bits = 0;
        else if (i / BLOCK == 3)
            bits = 0x40490fdbu;
        else if (i % 3)
            bits = (bits & 0x807fffffu) | ((uint32_t)(100 + state % 60) << 23);
        memcpy(&values[i], &bits, 4);
    }
}

int main(void)
{
    static float values[COUNT], rounded[COUNT], decoded[COUNT];
    static uint16_t bf16[COUNT];
    static uint8_t fp8[COUNT + 4 * ((COUNT + BLOCK - 1) / BLOCK)];
    printf("best %s of %s (the module starts on %s)\n", best()->name, runnable_names(),
           active->name);
    for (Py_ssize_t v = 0; v < VARIANT_COUNT; v++) {
        const Variant *kernels = all_variants[v];
        if (runnable(kernels->name) == NULL)
            continue;
        uint64_t hash = 0xcbf29ce484222325ULL;
        fill(values);
        memcpy(rounded, values, sizeof values);
        kernels->bf16_encode(rounded, bf16, COUNT);
        hash = fnv(bf16, sizeof bf16, fnv(rounded, sizeof rounded, hash));
        kernels->bf16_decode(bf16, decoded, COUNT, 0);
        kernels->bf16_decode(bf16, decoded, COUNT, 1);
        hash = fnv(decoded, sizeof decoded, hash);
        memcpy(rounded, values, sizeof values);
        kernels->fp8_encode(rounded, fp8, COUNT);
        hash = fnv(fp8, sizeof fp8, fnv(rounded, sizeof rounded, hash));
        kernels->fp8_decode(fp8, decoded, COUNT, 0);
        kernels->fp8_decode(fp8, decoded, COUNT, 1);
        hash = fnv(decoded, sizeof decoded, hash);
        printf("variant %s %016llx\n", kernels->name, (unsigned long long)hash);
    }
    return 0;
}
