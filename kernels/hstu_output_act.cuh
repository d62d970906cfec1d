/* The activations of HSTU's output section (TF_ACT_NONE / SILU / SIGMOID of hstu_output_kernels.h),
 * shared by the output op's kernels (hstu_output_cuda.cu) and the skinny linear's output prologue
 * (skinny_prologue.cuh), so that both compute the same values bit for bit.
 *
 * sigmoid(x) = rcp(1 + exp(-x)) with the hardware exponential (__expf: ex2.approx, 2 + 1.16|x| fp32 ulps
 * by CUDA's documentation) and a correctly rounded reciprocal, silu(x) = x * sigmoid(x): about 1e-6
 * relative of PyTorch's x / (1 + expf(-x)) at |x| = 10, fewer ulps nearer 0 (below a bf16 or fp16
 * output's rounding). PyTorch's accurate expf and IEEE division cost the instruction-bound backward
 * (three activations per element) about a tenth of its time. Where exp(-x) overflows, sigmoid is 0 and
 * silu -0, as in PyTorch. */
#ifndef TF_HSTU_OUTPUT_ACT_CUH
#define TF_HSTU_OUTPUT_ACT_CUH

#include "hstu_output_kernels.h"

static __device__ __forceinline__ float hstu_act(float x, int act) {
    if (act == TF_ACT_NONE) return x;
    const float s = __frcp_rn(1.f + __expf(-x));
    return act == TF_ACT_SILU ? x * s : s;
}

static __device__ __forceinline__ float hstu_act_grad(float x, int act) {
    if (act == TF_ACT_NONE) return 1.f;
    const float s = __frcp_rn(1.f + __expf(-x));
    return act == TF_ACT_SILU ? s * (1.f + x * (1.f - s)) : s * (1.f - s);
}

/* hstu_act and hstu_act_grad together, bit for bit the same values, from one exponential. */
static __device__ __forceinline__ void hstu_act_fg(float x, int act, float &f, float &g) {
    if (act == TF_ACT_NONE) {
        f = x;
        g = 1.f;
        return;
    }
    const float s = __frcp_rn(1.f + __expf(-x));
    f = act == TF_ACT_SILU ? x * s : s;
    g = act == TF_ACT_SILU ? s * (1.f + x * (1.f - s)) : s * (1.f - s);
}

#endif
