/* The activations of HSTU's output section (TF_ACT_NONE / SILU / SIGMOID of hstu_output_kernels.h),
 * shared by the output op's kernels (hstu_output_cuda.cu) and the skinny linear's output prologue
 * (skinny_prologue.cuh), so that both compute the same values bit for bit. */
#ifndef TF_HSTU_OUTPUT_ACT_CUH
#define TF_HSTU_OUTPUT_ACT_CUH

#include "hstu_output_kernels.h"

static __device__ __forceinline__ float hstu_act(float x, int act) {
    if (act == TF_ACT_SILU) return x / (1.f + expf(-x));
    if (act == TF_ACT_SIGMOID) return 1.f / (1.f + expf(-x));
    return x;
}

static __device__ __forceinline__ float hstu_act_grad(float x, int act) {
    if (act == TF_ACT_NONE) return 1.f;
    const float s = 1.f / (1.f + expf(-x));
    return act == TF_ACT_SILU ? s * (1.f + x * (1.f - s)) : s * (1.f - s);
}

/* hstu_act and hstu_act_grad together, bit for bit the same values, from one exponential. */
static __device__ __forceinline__ void hstu_act_fg(float x, int act, float &f, float &g) {
    if (act == TF_ACT_NONE) {
        f = x;
        g = 1.f;
        return;
    }
    const float den = 1.f + expf(-x), s = 1.f / den;
    f = act == TF_ACT_SILU ? x / den : s;
    g = act == TF_ACT_SILU ? s * (1.f + x * (1.f - s)) : s * (1.f - s);
}

#endif
