/* Hopper (sm_90a) warpgroup MMA wrappers. The instruction wrappers (one per shape and dtype, each naming
 * every accumulator register) are generated into tf_wgmma_ops.cuh by tools/gen_wgmma.py.
 *
 * wgmma_ss<T, N>(d, desc_a, desc_b, accumulate): D(64 x N, fp32) (+)= A(64 x 16) B(16 x N), A and B
 *   K-major in shared memory (descriptors: tf_wgmma_desc_*).
 * wgmma_ss_tb<T, N>(d, desc_a, desc_b, accumulate): the same with B MN-major ("transposed").
 * wgmma_ss_tt<T, N>(d, desc_a, desc_b, accumulate): the same with A and B both MN-major.
 * wgmma_rs<T, N>(d, a, desc_b, accumulate): D (+)= A B with A from registers (the mma.sync m16n8k16 A fragment of
 *   the warp's 16 rows) and B MN-major ("transposed") in shared memory.
 * Accumulator layout (per warp w of the warpgroup, lane = 4 g + t): d[4 j + e] is row 16 w + g + 8 (e / 2),
 * column 8 j + 2 t + (e % 2).
 * The instructions are asynchronous: tf_wgmma_fence() before the first of a batch, commit, then
 * tf_wgmma_wait<n>() and tf_wgmma_reg_fence() on the accumulators before reading them. */
#ifndef TF_WGMMA_CUH
#define TF_WGMMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ void tf_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void tf_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void tf_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
/* Keeps the compiler from moving reads or writes of accumulator registers across the async MMAs. */
template <int N>
__device__ __forceinline__ void tf_wgmma_reg_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/* Shared-memory matrix descriptor, 128-byte swizzle (bits 62-63 = 1). Addresses in 16-byte units.
 * K-major: rows of 128 bytes (64 elements), 8-row groups 1024 bytes apart (SBO); LBO unused.
 * MN-major: 64-element blocks of the MN dimension `lbo` bytes apart, 8-row K groups 1024 bytes apart. */
__device__ __forceinline__ uint64_t tf_wgmma_desc(uint32_t smem_addr, uint32_t lbo_bytes) {
    uint64_t d = (uint64_t)((smem_addr & 0x3FFFF) >> 4);
    d |= (uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_tb(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_tt(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int accumulate);

#include "tf_wgmma_ops.cuh"

/* Tile GEMMs on 128-byte-swizzled shared memory (rows of 64 16-bit elements; a tile wider than 64 is
 * stored as panels of 64 columns, one after another). Issued, not waited for.
 *
 * tf_gemm_ss<T, K, A_ROWS, N, B_ROWS>: acc (64 x N) = A B^T over K (a multiple of 16), A's 64 rows and
 *   B's N rows both K-major; A's panels hold A_ROWS rows (A may be rows 64 r.. of a taller tile: pass its
 *   address), B's B_ROWS (N by default; B may be rows r.. of a taller tile, r a multiple of 8). All K / 16
 *   steps even where the tail of K is zero padding: a branch between two wgmmas makes the compiler wait
 *   for the first. */
template <typename T, int K, int A_ROWS, int N, int B_ROWS = N>
__device__ __forceinline__ void tf_gemm_ss(float (&acc)[N / 2], uint32_t a_addr, uint32_t b_addr) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        // 16 columns: panel kk / 4, 32 bytes into its rows per step
        const uint32_t koff = (kk % 4) * 32;
        wgmma_ss<T, N>(acc, tf_wgmma_desc(a_addr + (kk / 4) * A_ROWS * 128 + koff, 0),
                       tf_wgmma_desc(b_addr + (kk / 4) * B_ROWS * 128 + koff, 0), kk > 0);
    }
}
/* tf_gemm_ss_tt<T, N, K>: acc (64 x N) += A B, A (64 x K) stored MN-major as K rows of 64 elements (one
 *   128-byte row each: a tile stored transposed), B's K rows of N columns MN-major (panels of 64
 *   columns, K rows each), both in shared memory. */
template <typename T, int N, int K>
__device__ __forceinline__ void tf_gemm_ss_tt(float (&acc)[N / 2], uint32_t a_addr, uint32_t b_addr) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)  // 16 rows of A and of B per step; B's LBO: its panel stride
        wgmma_ss_tt<T, N>(acc, tf_wgmma_desc(a_addr + kk * 16 * 128, 0), tf_wgmma_desc(b_addr + kk * 16 * 128, K * 128),
                          1);
}
/* tf_gemm_rs<T, N, K>: acc (64 x N) += A B, A from registers (K / 16 mma.sync A fragments), B's K rows
 *   of N columns MN-major (panels of 64 columns, K rows each). */
template <typename T, int N, int K>
__device__ __forceinline__ void tf_gemm_rs(float (&acc)[N / 2], const uint32_t (&a)[K / 16][4], uint32_t b_addr) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)  // 16 rows of B (two 8-row groups) per step; LBO: panel stride
        wgmma_rs<T, N>(acc, a[kk], tf_wgmma_desc(b_addr + kk * 16 * 128, K * 128), 1);
}

#endif /* TF_WGMMA_CUH */
