/* Counter-based random numbers for dropout masks: Philox4x32-10 (Salmon et al., SC'11), the generator
 * behind curand's and PyTorch's fused dropout.
 *
 * Why counter-based: a mask bit is a pure function of (seed, offset, element index), so a backward
 * kernel regenerates exactly the forward's mask instead of reading a stored one, and the CPU and CUDA
 * paths draw the same mask for the same seed (tests compare them).
 *
 * Element e of a call's mask uses word (e mod 4) of philox(counter = {e/4 lo, e/4 hi, offset lo,
 * offset hi}, key = {seed lo, seed hi}). A call therefore consumes one offset value; the glue reserves
 * 4 from torch's generator per call (its increments must be multiples of 4).
 *
 * Plain C with host/device qualifiers under nvcc; no torch headers. */
#ifndef TF_PHILOX_H
#define TF_PHILOX_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define TF_PHILOX_HD __host__ __device__ __forceinline__
#else
#define TF_PHILOX_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Where a call's seed and offset come from. Under CUDA graph capture PyTorch's generator hands out
 * device pointers that replays update (at::PhiloxCudaState); kernels resolve them with
 * tf_philox_resolve() on the device, so a captured graph draws a fresh mask each replay. */
typedef struct {
    uint64_t seed, offset;               /* used when seed_ptr is NULL */
    const int64_t *seed_ptr;             /* device pointers (captured), or NULL */
    const int64_t *offset_ptr;
    uint64_t offset_intragraph;
} tf_philox_args;

TF_PHILOX_HD void tf_philox_resolve(const tf_philox_args *a, uint64_t *seed, uint64_t *offset) {
    if (a->seed_ptr) {
        *seed = (uint64_t)*a->seed_ptr;
        *offset = (uint64_t)*a->offset_ptr + a->offset_intragraph;
    } else {
        *seed = a->seed;
        *offset = a->offset;
    }
}

TF_PHILOX_HD uint32_t tf_mulhilo32(uint32_t a, uint32_t b, uint32_t *hi) {
    const uint64_t p = (uint64_t)a * (uint64_t)b;
    *hi = (uint32_t)(p >> 32);
    return (uint32_t)p;
}

/* Four 32-bit words for counter block `block` (element indices 4*block .. 4*block+3). */
TF_PHILOX_HD void tf_philox4x32_10(uint64_t seed, uint64_t offset, uint64_t block, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)block, c1 = (uint32_t)(block >> 32);
    uint32_t c2 = (uint32_t)offset, c3 = (uint32_t)(offset >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; ++r) {
        uint32_t hi0, hi1;
        const uint32_t lo0 = tf_mulhilo32(0xD2511F53u, c0, &hi0);
        const uint32_t lo1 = tf_mulhilo32(0xCD9E8D57u, c2, &hi1);
        const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* Uniform in [0, 1) with 24 bits, exactly representable in float. */
TF_PHILOX_HD float tf_philox_uniform(uint32_t w) { return (float)(w >> 8) * (1.0f / 16777216.0f); }

/* Keep decision for element e of a call: kept with probability 1 - p. Kernels that walk elements in
 * fours should call tf_philox4x32_10 once per block instead. */
TF_PHILOX_HD int tf_philox_keep(uint64_t seed, uint64_t offset, uint64_t e, float p) {
    uint32_t w[4];
    tf_philox4x32_10(seed, offset, e >> 2, w);
    return tf_philox_uniform(w[e & 3]) >= p;
}

/* Keep decisions from 16 bits each, eight per Philox block (half the blocks, so half the generator's
 * arithmetic, of tf_philox_keep's 24-bit uniforms; for masks over whole tensors in memory-bound
 * kernels): element e uses half (e & 1) (0: the low half) of word ((e >> 1) & 3) of block e >> 3 and is kept
 * when that half is >= tf_philox_threshold16(p) = ceil(p * 65536): with probability 1 - p, p rounded up
 * to a multiple of 2^-16. */
TF_PHILOX_HD uint32_t tf_philox_threshold16(float p) { return (uint32_t)ceilf(p * 65536.0f); }

TF_PHILOX_HD int tf_philox_keep16(uint32_t word, int half, uint32_t threshold) {
    return ((half ? word >> 16 : word & 0xFFFFu) >= threshold);
}

#ifdef __cplusplus
}
#endif

#endif
