/* HSTU attention backward on Hopper (sm_90a), part two of the head-dim 65-256 backward: dQ = dZ K.
 *
 * hstu_bwd_sm90.cu's DZ form leaves, for every (key tile, query tile) its mask reaches, the 64 x KT dZ tile
 * (query rows, keys along the row; KT = the backward's key tile: 64 keys at head dims 129-256, 128 at
 * 65-128, in 64-key panels) in p.dz as it lay in shared memory (128-byte swizzled, 8 or 16 KB) at slot
 * ((b H + h) k_tiles + key tile) q_tiles + query tile, and computes no dQ. Here:
 *   - work item = (64-row query tile, sequence, head), one block of one warpgroup (128 threads) each, the
 *     query tiles of a (sequence, head) pair side by side in the grid, longest first, so that the pair's
 *     K tiles are read from L2 by all of them (taken query tile first across all pairs, K left L2 and
 *     the GEMM ran at half the speed: docs/design/hstu.md);
 *   - the key tiles are exactly those the backward stored for this query tile: tf_hstu_row_range per key
 *     tile, as bwd_item lists a key tile's query tiles (context tiles first, then the causal or windowed
 *     range);
 *   - thread 0 loads each key tile's K (TMA, D / 64 swizzled panels of KT keys) and its raw dZ tile (one
 *     bulk copy, already in the operand layout) into one of two stages, the next tile's while the
 *     warpgroup runs dQ += dZ K (wgmma, both operands in shared memory: A = dZ K-major, B = K MN-major,
 *     as the backward's own dQ step); K's rows past the sequence's end are zeroed before use (they are
 *     the next sequence's, and 0 x inf is not 0);
 *   - dQ (64 x D fp32, D / 2 registers a thread) is stored once, in the caller's dtype, into p.dq:
 *     16-byte stores after a transpose within each quad where rows and columns allow, else per element.
 * No fp32 buffer, no zeroing, no conversion pass. */
#include <cuda_runtime.h>

#include "hstu_mma.cuh"
#include "tf_sm90.cuh"
#include "tf_wgmma.cuh"

namespace {

constexpr int kTile = 64;  // query rows of a dZ tile

template <int D>
struct DqCfg {
    static constexpr int KT = hstu_sm90_key_tile(D);     // keys of a dZ tile: the backward's key tile
    static constexpr int PANELS = D / 64;                 // K's 64-column panels
    static constexpr int K_BYTES = KT * D * 2, Z_BYTES = kTile * KT * 2;
    static constexpr int STAGE = K_BYTES + Z_BYTES;      // K, then dZ
    static constexpr int SMEM = 2 * STAGE + 1024;        // +1024: stages start on the swizzle's period
};

static_assert(DqCfg<256>::SMEM <= 232448 / 2 && DqCfg<128>::SMEM <= 232448 / 2, "two blocks an SM");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* Whether the backward stored the tile (key tile kt of KT keys, query tile qt): qt is among the query
 * tiles bwd_item lists for key tile kt (a key tile starting at or past n has none). */
template <int KT>
__device__ __forceinline__ bool dz_stored(const tf_hstu_mask &mask, int n, int kt, int qt) {
    const int k0 = kt * KT;
    if (k0 >= n) return false;
    const HstuQueryTiles q = hstu_query_tiles<kTile>(mask, k0, min(k0 + KT, n));
    return qt < q.nctx || (qt >= q.lo_t && qt <= q.hi_t);
}
/* The first key tile >= kt whose dZ tile the backward stored for query tile qt, or tiles. */
template <int KT>
__device__ __forceinline__ int next_stored(const tf_hstu_mask &mask, int n, int tiles, int kt, int qt) {
    while (kt < tiles && !dz_stored<KT>(mask, n, kt, qt)) ++kt;
    return kt;
}
#endif

template <typename T, int D>
__global__ void __launch_bounds__(128, 2)
    hstu_bwd_dq(const __grid_constant__ CUtensorMap tm_k, const tf_hstu_params p, int k_tiles, int q_tiles, int vec) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = DqCfg<D>;
    constexpr int KT = C::KT;
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    __shared__ __align__(8) uint64_t full[2];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
    const int pair = (int)(blockIdx.x / q_tiles), qt = q_tiles - 1 - (int)(blockIdx.x % q_tiles);
    const int H = (int)p.H, h = pair % H;
    const HstuSeq s = hstu_seq(p, pair / H);
    const int n = s.n, q0 = qt * kTile;
    if (q0 >= n) return;
    if (tid == 0) {
        mbar_init(&full[0], 1);
        mbar_init(&full[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const char *dz = (const char *)p.dz + ((int64_t)pair * k_tiles * q_tiles + qt) * C::Z_BYTES;
    auto issue = [&](int kt, int st) {  // thread 0: key tile kt's K and dZ into stage st
        uint8_t *ks = smem + st * C::STAGE;
        mbar_expect_tx(&full[st], C::STAGE);
#pragma unroll
        for (int c = 0; c < C::PANELS; ++c) tma_load(ks + c * KT * 128, &tm_k, 64 * c, h, (int)(s.start + kt * KT), &full[st]);
        bulk_load(smem_u32(ks + C::K_BYTES), dz + (int64_t)kt * q_tiles * C::Z_BYTES, C::Z_BYTES, &full[st]);
    };
    const int tiles = (n + KT - 1) / KT;
    int kt = next_stored<KT>(s.mask, n, tiles, 0, qt);
    if (tid == 0 && kt < tiles) issue(kt, 0);
    float acc[C::PANELS][32];
#pragma unroll
    for (int c = 0; c < C::PANELS; ++c)
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[c][i] = 0.f;
    for (int it = 0; kt < tiles; ++it) {
        const int st = it & 1, nk = next_stored<KT>(s.mask, n, tiles, kt + 1, qt);
        // stage st ^ 1 was last read by the previous tile's wgmmas, complete at its closing barrier
        if (tid == 0 && nk < tiles) issue(nk, st ^ 1);
        mbar_wait(&full[st], (it >> 1) & 1);
        uint8_t *ks = smem + st * C::STAGE;
        if (kt * KT + KT > n) {  // K's rows past the end: zeroed (every panel)
            zero_rows<D, KT>(ks, n - kt * KT);
            fence_proxy_async();
            __syncthreads();
        }
        const uint32_t k_addr = smem_u32(ks), z_addr = k_addr + C::K_BYTES;
        tf_wgmma_fence();
#pragma unroll
        for (int c = 0; c < C::PANELS; ++c)
#pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk)  // dZ: key panel kk / 4 (64 rows of 128 bytes), 16 keys at (kk % 4) 32 bytes
                wgmma_ss_tb<T, 64>(acc[c], tf_wgmma_desc(z_addr + (kk / 4) * kTile * 128 + (kk % 4) * 32, 0),
                                   tf_wgmma_desc(k_addr + c * KT * 128 + kk * 16 * 128, KT * 128), 1);
        tf_wgmma_commit();
        tf_wgmma_wait<0>();
#pragma unroll
        for (int c = 0; c < C::PANELS; ++c) tf_wgmma_reg_fence(acc[c]);
        __syncthreads();  // every warp is done with stage st before it is loaded again
        kt = nk;
    }
    // element 4 j + 2 hh + e of acc[c]: row q0 + 16 warp + g + 8 hh, column 64 c + 8 j + 2 t4 + e
    const int dqk = (int)p.dqk;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = q0 + 16 * warp + g + 8 * hh;
        T *row = (T *)p.dq + (s.start + r) * p.dq_sr + (int64_t)h * dqk;
#pragma unroll
        for (int c = 0; c < C::PANELS; ++c) {
            if (vec) {
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const uint4 v = quad_chunk<T>(acc[c], hh, m);  // every lane
                    const int col = 64 * c + 8 * (4 * m + t4);
                    if (r < n && col < dqk) *(uint4 *)(row + col) = v;
                }
            } else if (r < n) {
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = 64 * c + 8 * j + 2 * t4 + e;
                        if (col < dqk) {
                            const uint32_t two = pack2<T>(acc[c][4 * j + 2 * hh + e], 0.f);
                            row[col] = *reinterpret_cast<const T *>(&two);
                        }
                    }
            }
        }
    }
#endif
}

#if defined(TF_BUILT_SM90A)
template <typename T, int D>
int launch_dq(const tf_hstu_params &p, cudaStream_t stream) {
    constexpr int KT = DqCfg<D>::KT;
    const int64_t k_tiles = (p.max_seq_len + KT - 1) / KT, q_tiles = (p.max_seq_len + kTile - 1) / kTile;
    const int64_t blocks = q_tiles * p.B * p.H;
    if (blocks == 0) return 0;
    if (blocks > 0x7fffffff) return (int)cudaErrorInvalidConfiguration;
    CUtensorMap tk;
    if (!tensor_map(&tk, p.dtype, p.k, p.L, p.H, p.dqk, p.k_sr, p.k_sh, KT)) return (int)cudaErrorInvalidValue;
    cudaError_t err = cudaFuncSetAttribute(hstu_bwd_dq<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, DqCfg<D>::SMEM);
    if (err != cudaSuccess) return (int)err;
    // 16-byte stores where every row's head starts 16-byte aligned and whole chunks reach dqk
    const int vec = p.dqk % 8 == 0 && p.dq_sr % 8 == 0 && reinterpret_cast<uintptr_t>(p.dq) % 16 == 0;
    hstu_bwd_dq<T, D><<<(unsigned)blocks, 128, DqCfg<D>::SMEM, stream>>>(tk, p, (int)k_tiles, (int)q_tiles, vec);
    return (int)cudaGetLastError();
}
#endif

}  // namespace

extern "C" int tf_hstu_bwd_dq_sm90(const tf_hstu_params *p, void *stream) {
#if defined(TF_BUILT_SM90A)
    if (!p->dz || !p->dq) return (int)cudaErrorInvalidValue;
    // the head dim the backward that stored the tiles ran at, so its key tile
    const cudaStream_t s = (cudaStream_t)stream;
    if (p->dtype == TF_BF16)
        return hstu_two_part_head_dim(*p, [&](auto D) { return launch_dq<__nv_bfloat16, decltype(D)::value>(*p, s); });
    if (p->dtype == TF_F16)
        return hstu_two_part_head_dim(*p, [&](auto D) { return launch_dq<__half, decltype(D)::value>(*p, s); });
#else
    (void)p;
    (void)stream;
#endif
    return (int)cudaErrorInvalidValue;
}
