/* Compile-time-dtype conversions for kernels templated on their element type T (float, __half,
 * __nv_bfloat16): widening to fp32 and rounding back to nearest even, as PyTorch rounds. */
#ifndef TF_TYPED_CUH
#define TF_TYPED_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

template <typename T>
static __device__ __forceinline__ float to_f(T v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
    else return __half2float(v);
}

template <typename T>
static __device__ __forceinline__ T from_f(float v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
    else return __float2half_rn(v);
}

#endif
