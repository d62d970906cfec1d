/* Hopper (sm_90a) building blocks shared by the warp-specialized kernels: mbarriers, named barriers,
 * the tensor-memory-access (TMA) copy engine, and the host side (tensor maps, device queries).
 * Device code only where the architecture-specific features are compiled (__CUDA_ARCH_FEAT_SM90_ALL);
 * host code only in builds that include sm_90a (TF_BUILT_SM90A). */
#ifndef TF_SM90_CUH
#define TF_SM90_CUH

#include <cuda.h>  // CUtensorMap (the encoder is fetched from the driver at run time: no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "tf_dtype.h"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
static __device__ __forceinline__ uint32_t tf_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
static __device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tf_smem_u32(bar)), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(tf_smem_u32(bar)), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(tf_smem_u32(bar)) : "memory");
}
static __device__ __forceinline__ void mbar_wait(uint64_t *bar, int parity) {
    asm volatile(
        "{\n.reg .pred P1;\nLAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(tf_smem_u32(bar)),
        "r"(parity)
        : "memory");
}
/* named barrier `id` over `n` threads (a multiple of 32): wait for it / arrive without waiting */
static __device__ __forceinline__ void named_bar_sync_n(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
static __device__ __forceinline__ void named_bar_arrive_n(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
/* named barrier `id` over the two consumer warpgroups (256 threads): wait for it / arrive without waiting */
static __device__ __forceinline__ void named_bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
static __device__ __forceinline__ void named_bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
/* box {64 columns, 1 head, rows} of a (rows, H, d) tensor at (c0, c1, c2) -> smem (128-byte swizzled rows) */
static __device__ __forceinline__ void tma_load(void *dst, const CUtensorMap *map, int c0, int c1, int c2, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
            tf_smem_u32(dst)),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(tf_smem_u32(bar))
        : "memory");
}
/* generic-proxy writes to shared memory (st.shared) -> visible to the async proxy (wgmma, TMA) */
static __device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
/* smem (shared-space address src) -> global reduce-add (element-wise atomic, the map's element type) of one
 * box at (c0, c1, c2) of a 3-d map, asynchronous: tracked by the issuing thread's bulk async-groups
 * (commit / wait below) */
static __device__ __forceinline__ void tma_reduce_add(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
            (uint64_t)map),
        "r"(src), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
/* smem (128-byte-swizzled rows, shared-space address src) -> global: one box at (c0, c1, c2) of a 3-d map,
 * asynchronous, tracked by the issuing thread's bulk async-groups; a box reaching past the map's dims is
 * clipped (nothing written there) */
static __device__ __forceinline__ void tma_store(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                     (uint64_t)map),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
/* Plain (non-tensor) bulk copies of `bytes` (a multiple of 16, 16-byte aligned ends): shared memory ->
 * global (base + off; bulk group, as tma_store), and global -> shared memory (completes on bar's tx count). */
static __device__ __forceinline__ void bulk_store(void *base, int64_t off, uint32_t src, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"((char *)base + off), "r"(src),
                 "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, int bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(tf_smem_u32(bar))
                 : "memory");
}
static __device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* this thread's bulk groups have finished reading their shared-memory sources (which may be rewritten) */
static __device__ __forceinline__ void bulk_wait_group_read0() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
/* this thread's bulk groups have completed (their global writes done) */
static __device__ __forceinline__ void bulk_wait_group0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
#endif

#if defined(TF_BUILT_SM90A)
/* The current device's L2 size and SM count, queried once per device (benign race: every writer
 * stores the same values). */
struct DeviceSizes {
    int l2, sms;
};
static inline DeviceSizes device_sizes() {
    static DeviceSizes cached[64];
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 0 || dev >= 64) dev = 0;
    if (cached[dev].sms == 0) {
        DeviceSizes d{0, 0};
        cudaDeviceGetAttribute(&d.l2, cudaDevAttrL2CacheSize, dev);
        cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
        if (d.sms <= 0) d.sms = 1;
        cached[dev] = d;
    }
    return cached[dev];
}

/* Scheduling sections: how many of `units` work units (e.g. (sequence, head) pairs) of `unit_bytes` each
 * (what their blocks read repeatedly) fit in half the L2 cache together, but at least enough to fill
 * the GPU with `blocks_per_unit` blocks each. Blocks ordered section by section keep their reads in L2. */
static inline int l2_section(int64_t unit_bytes, int64_t units, int blocks_per_unit) {
    const int l2 = device_sizes().l2, sms = device_sizes().sms;
    int64_t sec = unit_bytes > 0 ? (int64_t)l2 / 2 / unit_bytes : 1;
    const int64_t fill = (sms + blocks_per_unit - 1) / blocks_per_unit;
    if (sec < fill) sec = fill;
    if (sec > units) sec = units;
    return (int)(sec > 0 ? sec : 1);
}

/* The driver's tensor-map encoder, fetched once through the runtime (no link against libcuda). */
static inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    static bool tried = false;
    if (!tried) {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)f;
        tried = true;
    }
    return fn;
}

/* TMA map of a (rows, H, d) 16-bit tensor read in boxes of {64 columns, 1 head, box_rows rows} into
 * 128-byte-swizzled shared memory. False when the copy engine cannot address it (strides or base not
 * 16-byte aligned, no rows). */
static inline bool tensor_map(CUtensorMap *m, int dtype, const void *base, int64_t rows, int64_t H, int64_t d, int64_t sr,
                int64_t sh, int box_rows) {
    PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
    if (!enc || rows <= 0 || ((uintptr_t)base & 15) != 0) return false;
    const int64_t sr_b = sr * 2, sh_b = H > 1 ? sh * 2 : sr_b;  // one head: its stride is never stepped
    if (sr_b % 16 != 0 || sh_b % 16 != 0 || sr_b <= 0 || sh_b <= 0) return false;
    const cuuint64_t dims[3] = {(cuuint64_t)d, (cuuint64_t)H, (cuuint64_t)rows};
    const cuuint64_t strides[2] = {(cuuint64_t)sh_b, (cuuint64_t)sr_b};
    const cuuint32_t box[3] = {64, 1, (cuuint32_t)box_rows}, elem[3] = {1, 1, 1};
    return enc(m, dtype == TF_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
               const_cast<void *>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* TMA map of a contiguous fp32 (rows, H, d) tensor written (reduce-add) from boxes of {32 columns, 1 head,
 * box_rows rows} in 128-byte-swizzled shared memory (the swizzle's row is 128 bytes: 32 floats). A box
 * reaching past d, H or rows is clipped (nothing written there). False when the copy engine cannot
 * address it (base or strides not 16-byte aligned, no rows). */
static inline bool tensor_map_f32_reduce(CUtensorMap *m, float *base, int64_t rows, int64_t H, int64_t d, int box_rows) {
    PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
    if (!enc || rows <= 0 || d <= 0 || H <= 0 || ((uintptr_t)base & 15) != 0) return false;
    const int64_t sr_b = H * d * 4, sh_b = H > 1 ? d * 4 : sr_b;  // one head: its stride is never stepped
    if (sr_b % 16 != 0 || sh_b % 16 != 0) return false;
    const cuuint64_t dims[3] = {(cuuint64_t)d, (cuuint64_t)H, (cuuint64_t)rows};
    const cuuint64_t strides[2] = {(cuuint64_t)sh_b, (cuuint64_t)sr_b};
    const cuuint32_t box[3] = {32, 1, (cuuint32_t)box_rows}, elem[3] = {1, 1, 1};
    return enc(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, base, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* The current device is compute capability 9.0 exactly (sm_90a code runs nowhere else). */
static inline bool device_is_sm90() {
    static int cached[64];  // 0 unknown, 1 yes, 2 no (benign race: every writer stores the same value)
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (dev < 0 || dev >= 64) return false;
    if (!cached[dev]) {
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        cached[dev] = major == 9 && minor == 0 ? 1 : 2;
    }
    return cached[dev] == 1;
}
#endif

#endif /* TF_SM90_CUH */
