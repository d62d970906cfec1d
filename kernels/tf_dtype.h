/* Element types shared by every kernel family, and their float conversions for the CPU paths.
 *
 * Kernels take untyped pointers plus one of these codes, so a family is compiled once and not per
 * dtype combination (mixed-dtype ops such as a bf16 input with an fp32 residual stream would
 * otherwise multiply instantiations). Conversions round to nearest even, exactly as c10::Half and
 * c10::BFloat16 do, so a value rounded here is bit-identical to PyTorch's.
 *
 * Plain C; also valid C++ because setuptools compiles these sources with the C++ compiler. */
#ifndef TF_DTYPE_H
#define TF_DTYPE_H

#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TF_F32 = 0, TF_F16 = 1, TF_BF16 = 2 } tf_dtype;

static inline int tf_dtype_size(int dt) { return dt == TF_F32 ? 4 : 2; }

static inline float tf_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t tf_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float tf_bf16_to_f32(uint16_t h) { return tf_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t tf_f32_to_bf16(float f) {
    uint32_t u = tf_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                               /* nearest even */
    return (uint16_t)(u >> 16);
}

/* IEEE half <-> float, the branch-light formulation of the FP16 library that c10::Half uses. */
static inline float tf_f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float exp_scale = tf_bits_to_f32(0x7800000u); /* 2^-112 */
    const float normalized = tf_bits_to_f32((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = 126u << 23;
    const float magic_bias = 0.5f;
    const float denormalized = tf_bits_to_f32((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = 1u << 27;
    const uint32_t result = sign | (two_w < denormalized_cutoff ? tf_f32_to_bits(denormalized)
                                                                 : tf_f32_to_bits(normalized));
    return tf_bits_to_f32(result);
}

static inline uint16_t tf_f32_to_f16(float f) {
    const float scale_to_inf = tf_bits_to_f32(0x77800000u);  /* 2^112 */
    const float scale_to_zero = tf_bits_to_f32(0x08800000u); /* 2^-110 */
    float base = (f < 0 ? -f : f) * scale_to_inf;
    base *= scale_to_zero;
    const uint32_t w = tf_f32_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = tf_bits_to_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = tf_f32_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float tf_load_f32(const void *base, int dt, int64_t i) {
    if (dt == TF_F32) return ((const float *)base)[i];
    if (dt == TF_BF16) return tf_bf16_to_f32(((const uint16_t *)base)[i]);
    return tf_f16_to_f32(((const uint16_t *)base)[i]);
}

static inline void tf_store_f32(void *base, int dt, int64_t i, float v) {
    if (dt == TF_F32) ((float *)base)[i] = v;
    else if (dt == TF_BF16) ((uint16_t *)base)[i] = tf_f32_to_bf16(v);
    else ((uint16_t *)base)[i] = tf_f32_to_f16(v);
}

/* n elements of a dtype-dt tensor from element off, widened into (narrowed from) a float buffer: one
 * loop per dtype, so the compiler vectorises each. */
static inline void tf_row_to_f32(const void *base, int dt, int64_t off, int64_t n, float *out) {
    if (dt == TF_F32) {
        memcpy(out, (const float *)base + off, (size_t)n * sizeof(float));
    } else if (dt == TF_BF16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int64_t c = 0; c < n; ++c) out[c] = tf_bf16_to_f32(p[c]);
    } else {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int64_t c = 0; c < n; ++c) out[c] = tf_f16_to_f32(p[c]);
    }
}

static inline void tf_row_from_f32(void *base, int dt, int64_t off, int64_t n, const float *v) {
    if (dt == TF_F32) {
        memcpy((float *)base + off, v, (size_t)n * sizeof(float));
    } else if (dt == TF_BF16) {
        uint16_t *p = (uint16_t *)base + off;
        for (int64_t c = 0; c < n; ++c) p[c] = tf_f32_to_bf16(v[c]);
    } else {
        uint16_t *p = (uint16_t *)base + off;
        for (int64_t c = 0; c < n; ++c) p[c] = tf_f32_to_f16(v[c]);
    }
}

/* v rounded to dtype dt and widened back: what storing into a tensor of that dtype keeps. */
static inline float tf_round_f32(float v, int dt) {
    if (dt == TF_BF16) return tf_bf16_to_f32(tf_f32_to_bf16(v));
    if (dt == TF_F16) return tf_f16_to_f32(tf_f32_to_f16(v));
    return v;
}

#ifdef __cplusplus
}
#endif
#endif /* TF_DTYPE_H */
