/* Chunked, dtype-generic row access for memory-bound CUDA kernels.
 *
 * A chunk is 8 consecutive elements of one row, read or written by one thread. When the chunk is
 * whole and its address is 16-byte aligned it moves as 16-byte vectors (one for bf16/fp16, two for
 * fp32); otherwise element by element, so odd hidden sizes and unaligned rows stay correct at the
 * cost of narrower accesses for those chunks only. The dtype is a run-time code (tf_dtype.h): the
 * branch is uniform across the grid, and one compiled kernel serves every dtype combination. */
#ifndef TF_VEC_CUH
#define TF_VEC_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "tf_dtype.h"

#define TF_VEC 8

__device__ __forceinline__ float tf_round(float v, int dt) {
    if (dt == TF_BF16) return __bfloat162float(__float2bfloat16_rn(v));
    if (dt == TF_F16) return __half2float(__float2half_rn(v));
    return v;
}

/* base[i] of dtype dt as a float. */
__device__ __forceinline__ float tf_load_one(const void *base, int dt, int64_t i) {
    if (dt == TF_BF16) return __bfloat162float(((const __nv_bfloat16 *)base)[i]);
    if (dt == TF_F16) return __half2float(((const __half *)base)[i]);
    return ((const float *)base)[i];
}

__device__ __forceinline__ bool tf_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* v[0..n) = row[col .. col+n) as floats; v[n..8) = 0. */
__device__ __forceinline__ void tf_load_chunk(const void *row, int dt, int64_t col, int n, float (&v)[TF_VEC]) {
    if (dt == TF_F32) {
        const float *p = (const float *)row + col;
        if (n == TF_VEC && tf_aligned16(p)) {
            const float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) v[i] = i < n ? p[i] : 0.f;
        }
    } else {
        const uint16_t *p = (const uint16_t *)row + col;
        uint16_t h[TF_VEC];
        if (n == TF_VEC && tf_aligned16(p)) {
            const uint4 u = *(const uint4 *)p;
            memcpy(h, &u, sizeof(u));
        } else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) h[i] = i < n ? p[i] : (uint16_t)0;
        }
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) {
            if (dt == TF_BF16) v[i] = __bfloat162float(__ushort_as_bfloat16(h[i]));
            else v[i] = __half2float(__ushort_as_half(h[i]));
        }
    }
}

/* row[col .. col+n) = v[0..n), rounded to dt. */
__device__ __forceinline__ void tf_store_chunk(void *row, int dt, int64_t col, int n, const float (&v)[TF_VEC]) {
    if (dt == TF_F32) {
        float *p = (float *)row + col;
        if (n == TF_VEC && tf_aligned16(p)) {
            ((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
            ((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) if (i < n) p[i] = v[i];
        }
    } else {
        uint16_t *p = (uint16_t *)row + col;
        uint16_t h[TF_VEC];
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) {
            if (dt == TF_BF16) h[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v[i]));
            else h[i] = __half_as_ushort(__float2half_rn(v[i]));
        }
        if (n == TF_VEC && tf_aligned16(p)) {
            uint4 u;
            memcpy(&u, h, sizeof(u));
            *(uint4 *)p = u;
        } else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) if (i < n) p[i] = h[i];
        }
    }
}

/* A chunk as raw bytes, for kernels that know the element size B (2 or 4) at compile time: a row's
 * loads can all be issued into these before the first one is converted, so the loads of different
 * chunks and tensors are in flight together. */
template <int B>
struct TfRaw {
    uint4 q[B / 2];
};

template <int B>
__device__ __forceinline__ void tf_raw_load(TfRaw<B> &r, const void *row, int64_t col, int n) {
    const char *p = (const char *)row + col * B;
    if (n == TF_VEC && tf_aligned16(p)) {
#pragma unroll
        for (int i = 0; i < B / 2; ++i) r.q[i] = ((const uint4 *)p)[i];
    } else if constexpr (B == 2) {
        uint16_t h[TF_VEC];
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) h[i] = i < n ? ((const uint16_t *)p)[i] : (uint16_t)0;
        memcpy(r.q, h, sizeof(h));
    } else {
        uint32_t h[TF_VEC];
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) h[i] = i < n ? ((const uint32_t *)p)[i] : 0u;
        memcpy(r.q, h, sizeof(h));
    }
}

/* The raw chunk as floats; dt says which 16-bit format when B == 2. */
template <int B>
__device__ __forceinline__ void tf_raw_to_float(const TfRaw<B> &r, int dt, float (&v)[TF_VEC]) {
    if constexpr (B == 4) {
        memcpy(v, r.q, sizeof(v));
    } else {
        uint16_t h[TF_VEC];
        memcpy(h, r.q, sizeof(h));
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i)
            v[i] = dt == TF_BF16 ? __bfloat162float(__ushort_as_bfloat16(h[i])) : __half2float(__ushort_as_half(h[i]));
    }
}

/* Row base pointer of an untyped row-major matrix. */
__device__ __forceinline__ const void *tf_row(const void *base, int dt, int64_t row, int64_t stride) {
    return (const char *)base + row * stride * (dt == TF_F32 ? 4 : 2);
}
__device__ __forceinline__ void *tf_row(void *base, int dt, int64_t row, int64_t stride) {
    return (char *)base + row * stride * (dt == TF_F32 ? 4 : 2);
}

/* Sum of v over the blockDim.x threads of one row group. blockDim.x is a power of two; when it is
 * at most 32 a warp holds whole groups and every lane of the warp must call this; above 32 the
 * block is one group (blockDim.y == 1), every thread must call this, and `red` holds 32 floats.
 * The order of the additions is fixed, so the result is the same run to run. */
__device__ __forceinline__ float tf_group_sum(float v, float *red) {
    const int tpr = blockDim.x;
    for (int off = (tpr < 32 ? tpr : 32) / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (tpr <= 32) return v;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < (tpr >> 5) ? red[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
    __syncthreads(); /* red may be reused by the next call */
    return t;
}

#endif /* TF_VEC_CUH */
