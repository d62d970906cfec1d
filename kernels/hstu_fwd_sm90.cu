/* HSTU attention forward on Hopper (sm_90a): warpgroup MMA (wgmma) instead of mma.sync.
 *
 * Same semantics and scheduling as hstu_fwd_mma (hstu_fwd.cu): one block per (query tile of BM = 128
 * rows, sequence, head), highest tile first; the block walks the key tiles tf_hstu_col_range() allows.
 * Differences, all for the tensor cores' sake:
 *   - two warpgroups of 64 query rows each; S = Q K^T is one wgmma m64nBNk16 per 16 head dims with Q and
 *     K read by the tensor cores straight from shared memory (no ldmatrix); O += P V takes P from
 *     registers (the fp32 accumulators of S repacked to 16 bits, same fragment shape as mma.sync's A)
 *     and V from shared memory through the MN-major ("transposed") descriptor;
 *   - tiles are stored 128-byte swizzled (rows of 64 elements; the 16-byte chunk index XORed with the
 *     row index mod 8), the layout the wgmma descriptors describe; cp.async writes them there, so
 *     the writes are made visible to the tensor cores' (async) proxy with fence.proxy.async;
 *   - a warpgroup skips the MMAs of a key tile its own 64 rows cannot reach (the causal diagonal at
 *     D = 256, where key tiles are 64 wide; rows past the sequence's end).
 * K/V tiles go through a ring of 2-4 buffers (one barrier per tile); blocks are ordered so that those
 * sharing a (sequence, head)'s K and V run together (L2 reuse), longest tiles first within.
 * Built only for sm_90a (the `a` target: wgmma is not in plain sm_90); elsewhere the entry point
 * declines and hstu_fwd.cu's mma.sync kernel runs; it also declines where that one is faster (see
 * tf_hstu_fwd_sm90). TORCHFUSE_HSTU_SM90=0 / 1 forces the choice (A/B runs, tests). */
#include <cuda_runtime.h>
#include <stdlib.h>

#include "hstu_mma.cuh"
#include "tf_wgmma.cuh"

namespace {

constexpr int kWarpgroups = 2, kThreads = 128 * kWarpgroups, kBM = 64 * kWarpgroups;

template <int D>
struct Sm90Cfg {
    static constexpr int BN = D >= 256 ? 64 : 128;
    // K/V tiles in flight: as many as 227 KB of shared memory allows (one block per SM: nothing else
    // to switch to while a load is outstanding)
    static constexpr int ST = D <= 64 ? 4 : D <= 128 ? 3 : 2;
    static constexpr int Q_BYTES = kBM * D * 2, KV_BYTES = BN * D * 2;
    // Q, then the K and V rings; +1024: the swizzle pattern repeats every 1024 bytes, so tiles start on
    // a 1024-byte boundary
    static constexpr int SMEM = Q_BYTES + 2 * ST * KV_BYTES + 1024;
};

/* Byte offset of 16-byte chunk `c` of row `r` in a 128-byte-swizzled tile of ROWS rows: the row's
 * chunks 0-7 in panel 0 (ROWS x 128 bytes), 8-15 in panel 1, ... */
template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int r, int c) {
    return (uint32_t)((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* Tile row r <- global row base + r for r_lo <= r < nrows (columns below d); zeros elsewhere. */
template <int ROWS, int D>
__device__ __forceinline__ void load_tile_sw(uint8_t *smem, const void *g, int64_t sr, int64_t sh, int64_t base,
                                             int r_lo, int nrows, int h, int d) {
    constexpr int CH = D / 8;
    for (int i = threadIdx.x; i < ROWS * CH; i += kThreads) {
        const int r = i / CH, c = i % CH;
        const bool ok = r >= r_lo && r < nrows && c * 8 < d;
        const uint16_t *src = (const uint16_t *)g + (ok ? (base + r) * sr + (int64_t)h * sh + c * 8 : 0);
        cp_async16(smem + sw128<ROWS>(r, c), src, ok);
    }
}

/* Validity of this thread's accumulator elements in a key tile: bit 2 j + e of bits[h] is row p + 8 h,
 * column key0 + 8 j + e (j < BN / 8, e < 2; key0 includes the thread's 2 t offset). A rolled loop:
 * boundary tiles are few, and code size matters more than their speed. */
template <int BN>
__device__ __forceinline__ void mask_bits(const tf_hstu_mask &m, int p, int key0, uint32_t (&bits)[2]) {
    bits[0] = bits[1] = 0;
#pragma unroll 1
    for (int x = 0; x < BN / 2; ++x) {
        const int h = x / (BN / 4), c = x % (BN / 4);
        const int pos = p + 8 * h, key = key0 + (c / 2) * 8 + (c & 1);
        if (pos >= 0 && pos < m.n && key < m.n && tf_hstu_valid(&m, pos, key)) bits[h] |= 1u << c;
    }
}
__device__ __forceinline__ float silu_hx(float x, float c_h, float c_t) {
    const float hx = x * c_h;
    return fmaf(hx, tanh_approx(x * c_t), hx);
}
/* accumulator element i (= 4 j + 2 h + e) -> its bit */
__device__ __forceinline__ bool pair_bit(const uint32_t (&bits)[2], int i) {
    return (bits[(i >> 1) & 1] >> (2 * (i >> 2) + (i & 1))) & 1u;
}
/* out of line: called from an unrolled loop, so the dtype switch is not copied per element */
__device__ __noinline__ float bias_at(const tf_hstu_params &p, int64_t b, int h, int pos, int key) {
    return tf_bias_load(p.bias, p.bias_dtype, b * p.bias_sb + h * p.bias_sh + (int64_t)pos * p.bias_sr + key);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) hstu_fwd_wgmma(const tf_hstu_params p, int q_tiles, int section) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Cfg = Sm90Cfg<D>;
    constexpr int BN = Cfg::BN, KV_BYTES = Cfg::KV_BYTES, ST = Cfg::ST;
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *Qs = smem, *Ks = smem + Cfg::Q_BYTES, *Vs = Ks + ST * KV_BYTES;

    // Block order: (sequence, head) pairs in sections of `section` pairs whose K and V fit in L2 together;
    // within a section the query tiles with the most keys first (load balance), all pairs of the
    // section side by side, so the blocks reading one pair's K/V run at about the same time.
    const int64_t BH = p.B * p.H, per = (int64_t)q_tiles * section;
    const int64_t sec = blockIdx.x / per, r = blockIdx.x % per;
    const int64_t in_sec = min((int64_t)section, BH - sec * section);
    const int tile = q_tiles - 1 - (int)(r / in_sec);
    const int64_t bh = sec * section + r % in_sec;
    const int64_t b = bh / p.H;
    const int h = (int)(bh % p.H);
    const HstuSeq s = hstu_seq(p, b);
    const int i0 = tile * kBM;
    if (i0 >= s.nq) return;
    const int pos0 = s.n - s.nq + i0;
    const int p0 = pos0 > 0 ? pos0 : 0, p1 = min(pos0 + kBM, s.n);
    const int wg = threadIdx.x / 128;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t4 = lane % 4;
    const int rows_here = min(kBM, s.nq - i0);
    const int dqk = (int)p.dqk, dv = (int)p.dv;
    // SiLU(alpha x) / S_norm = h (1 + tanh(t)) with h = x alpha / (2 S_norm), t = x alpha / 2
    const float c_h = 0.5f * (float)p.alpha * (float)p.inv_scale, c_t = 0.5f * (float)p.alpha;
    const int wpos0 = pos0 + 64 * wg;  // this warpgroup's first row position

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;

    int kt_lo = 0, kt_hi = -1;
    if (p0 < p1) {
        int lo, hi;
        tf_hstu_col_range(&s.mask, p0, p1, &lo, &hi);
        kt_lo = lo / BN;
        kt_hi = hi / BN;
    }
    // the key columns this warpgroup's rows can reach ([wlo, whi]; empty when its rows lie outside)
    int wlo = 1 << 30, whi = -1;
    {
        const int a = max(wpos0, 0), z = min(wpos0 + 64, s.n);
        if (a < z) tf_hstu_col_range(&s.mask, a, z, &wlo, &whi);
    }
    if (kt_lo <= kt_hi) {
        load_tile_sw<kBM, D>(Qs, p.q, p.q_sr, p.q_sh, s.q_start + i0, -min(pos0, 0), rows_here, h, dqk);
        // K/V tile loads: every tile, a thread copies the same 16-byte column chunk `lc` of rows lr,
        // lr + RSTEP, ...: the pointers and the swizzled offsets are worked out once here (RSTEP is a
        // multiple of 8, so the swizzle term is the same for all of a thread's rows)
        constexpr int CH = D / 8, RSTEP = kThreads / CH, NLD = BN / RSTEP;
        const int lc = threadIdx.x % CH, lr = threadIdx.x / CH;
        const bool k_col = lc * 8 < dqk, v_col = lc * 8 < dv;
        const uint32_t ld_off = (lc >> 3) * (BN * 128) + lr * 128 + (((lc & 7) ^ (lr & 7)) << 4);
        const uint16_t *k_src = (const uint16_t *)p.k + (s.start + lr) * p.k_sr + (int64_t)h * p.k_sh + lc * 8;
        const uint16_t *v_src = (const uint16_t *)p.v + (s.start + lr) * p.v_sr + (int64_t)h * p.v_sh + lc * 8;
        const int64_t k_step = RSTEP * p.k_sr, v_step = RSTEP * p.v_sr;
        auto load_kv = [&](int kt) {
            const int k0 = kt * BN, nk = min(BN, s.n - k0);
            const uint16_t *kp = k_src + k0 * p.k_sr, *vp = v_src + k0 * p.v_sr;
            const int buf = (kt - kt_lo) % ST;
            uint8_t *kd = Ks + buf * KV_BYTES + ld_off, *vd = Vs + buf * KV_BYTES + ld_off;
#pragma unroll
            for (int j = 0; j < NLD; ++j) {
                const bool row = lr + j * RSTEP < nk;
                cp_async16(kd + j * RSTEP * 128, row && k_col ? kp + j * k_step : (const uint16_t *)p.k, row && k_col);
                cp_async16(vd + j * RSTEP * 128, row && v_col ? vp + j * v_step : (const uint16_t *)p.v, row && v_col);
            }
        };
        const uint32_t q_addr = smem_u32(Qs) + wg * 64 * 128;  // the warpgroup's 64 rows of each panel
        float sacc[BN / 2];
        uint32_t pa[BN / 16][4];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) sacc[i] = 0.f;
        auto reach = [&](int kt) { return kt * BN <= whi && kt * BN + BN - 1 >= wlo; };  // uniform per warpgroup
        // S = Q K^T for key tile kt (issued, not waited for). All D / 16 steps even when Dqk < D (the
        // padding is zeros): a branch between two wgmmas makes the compiler wait for the first.
        auto gemm_s = [&](int kt) {
            const uint32_t k_addr = smem_u32(Ks + ((kt - kt_lo) % ST) * KV_BYTES);
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                // 16 head dims: panel kk / 4 (64 dims each), 32 bytes into its rows per step
                const uint32_t koff = (kk % 4) * 32;
                wgmma_ss<T, BN>(sacc, tf_wgmma_desc(q_addr + (kk / 4) * kBM * 128 + koff, 0),
                                tf_wgmma_desc(k_addr + (kk / 4) * BN * 128 + koff, 0), kk > 0);
            }
        };
        // O += P V for key tile kt, P from the registers pa (issued, not waited for)
        auto gemm_pv = [&](int kt) {
            const uint32_t v_addr = smem_u32(Vs + ((kt - kt_lo) % ST) * KV_BYTES);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)  // 16 keys (two 8-row groups) per step; LBO: panel stride
                wgmma_rs<T, D>(o, pa[kk], tf_wgmma_desc(v_addr + kk * 16 * 128, BN * 128), 1);
        };
        // P = SiLU(alpha (S + bias)) / S_norm, masked, into pa. Interior tiles skip the mask; boundary
        // tiles get it as bits from a rolled loop (the mask and bias code unrolled over every element
        // made the kernel too big for the instruction cache: half its stalls were fetches).
        auto elementwise = [&](int kt) {
            const int k0 = kt * BN, prow = wpos0 + 16 * warp + g;  // this thread's rows: prow, prow + 8
            if (tf_hstu_tile_full(&s.mask, wpos0, wpos0 + 64, k0, k0 + BN) && !p.bias) {
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) sacc[i] = silu_hx(sacc[i], c_h, c_t);
            } else {
                uint32_t bits[2];
                mask_bits<BN>(s.mask, prow, k0 + 2 * t4, bits);
                if (p.bias) {
#pragma unroll
                    for (int i = 0; i < BN / 2; ++i)
                        if (pair_bit(bits, i))
                            sacc[i] += bias_at(p, b, h, prow + ((i & 2) ? 8 : 0), k0 + (i / 4) * 8 + 2 * t4 + (i & 1));
                }
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) sacc[i] = pair_bit(bits, i) ? silu_hx(sacc[i], c_h, c_t) : 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const float *c0 = sacc + 8 * kk;  // accumulator chunks 2 kk (keys +0..7), 2 kk + 1 (+8..15)
                pa[kk][0] = pack2<T>(c0[0], c0[1]);
                pa[kk][1] = pack2<T>(c0[2], c0[3]);
                pa[kk][2] = pack2<T>(c0[4], c0[5]);
                pa[kk][3] = pack2<T>(c0[6], c0[7]);
            }
        };
        // Per tile, both warpgroups: S, SiLU, P V; loads run ST - 1 tiles ahead. (A ping-pong order, one
        // warpgroup's SiLU beside the other's MMAs, measured slower: its role branches made the compiler
        // serialize the wgmmas, C7520.)
#pragma unroll
        for (int i = 0; i < ST - 1; ++i) {  // Q rides in the first group
            if (kt_lo + i <= kt_hi) load_kv(kt_lo + i);
            cp_async_commit();
        }
        for (int kt = kt_lo; kt <= kt_hi; ++kt) {
            cp_async_wait<ST - 2>();  // tile kt has landed (ST - 2 younger groups may be in flight)
            fence_proxy_async();      // this thread's cp.async writes -> the tensor cores' reads
            __syncthreads();          // ... everyone's; and every warpgroup is done with tile kt - 1
            if (kt + ST - 1 <= kt_hi) load_kv(kt + ST - 1);  // into tile kt - 1's buffers
            cp_async_commit();
            if (reach(kt)) {
                tf_wgmma_fence();
                gemm_s(kt);
                tf_wgmma_commit();
                tf_wgmma_wait<0>();
                tf_wgmma_reg_fence(sacc);
                elementwise(kt);
                tf_wgmma_fence();
                gemm_pv(kt);
                tf_wgmma_commit();
                tf_wgmma_wait<0>();
                tf_wgmma_reg_fence(o);
            }
        }
    }
    T *out = (T *)p.o;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = 64 * wg + 16 * warp + g + 8 * half;
        if (r >= rows_here) continue;
        T *orow = out + ((s.q_start + i0 + r) * p.H + h) * (int64_t)dv;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int col = 8 * j + 2 * t4;
            if (col < dv) *(uint32_t *)(orow + col) = pack2<T>(o[4 * j + 2 * half], o[4 * j + 2 * half + 1]);
        }
    }
#endif
}

/* (sequence, head) pairs per scheduling section: as many as have their K and V (at max_seq_len) in half
 * the L2 cache, and enough to fill the GPU. */
int section_size(const tf_hstu_params &p, int q_tiles) {
    int dev = 0, l2 = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t pair_bytes = p.max_seq_len * (p.dqk + p.dv) * 2;
    int64_t sec = pair_bytes > 0 ? (int64_t)l2 / 2 / pair_bytes : 1;
    const int64_t fill = (sms + q_tiles - 1) / q_tiles;
    if (sec < fill) sec = fill;
    const int64_t bh = p.B * p.H;
    if (sec > bh) sec = bh;
    return (int)(sec > 0 ? sec : 1);
}

template <typename T, int D>
cudaError_t launch(const tf_hstu_params &p, cudaStream_t stream) {
    const int64_t nq = p.delta > 0 ? p.delta : p.max_seq_len;
    const int q_tiles = (int)((nq + kBM - 1) / kBM);
    const int64_t blocks = (int64_t)q_tiles * p.B * p.H;
    if (blocks == 0) return cudaSuccess;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    constexpr int smem = Sm90Cfg<D>::SMEM;
    cudaError_t err = cudaFuncSetAttribute(hstu_fwd_wgmma<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    hstu_fwd_wgmma<T, D><<<(unsigned)blocks, kThreads, smem, stream>>>(p, q_tiles, section_size(p, q_tiles));
    return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch(const tf_hstu_params &p, cudaStream_t stream) {
    const int64_t d = p.dqk > p.dv ? p.dqk : p.dv;
    if (d <= 64) return launch<T, 64>(p, stream);
    if (d <= 128) return launch<T, 128>(p, stream);
    return launch<T, 256>(p, stream);
}

#if defined(TF_BUILT_SM90A)
/* The current device is compute capability 9.0 exactly (sm_90a code runs nowhere else). */
bool device_is_sm90() {
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

}  // namespace

extern "C" int tf_hstu_fwd_sm90(const tf_hstu_params *p, void *stream) {
#if defined(TF_BUILT_SM90A)
    if (p->dtype != TF_BF16 && p->dtype != TF_F16) return -1;
    const char *env = getenv("TORCHFUSE_HSTU_SM90");  // 0: never, 1: always, unset: where it is faster
    if (env && env[0] == '0') return -1;
    if (!device_is_sm90()) return -1;
    if (!(env && env[0] == '1')) {
        // Measured on an H100 (benchmarks/results/hstu_h100.md): ahead of mma.sync at head dims above 128
        // (1.7-2.3x, full and jagged lengths); at 128 ahead on long full-length sequences (1.4x at 4096)
        // but 5-12% behind at 1024, on jagged lengths and with windows (one block per SM here against two:
        // the per-block setup and the tail show); level at 64.
        const int64_t d = p->dqk > p->dv ? p->dqk : p->dv;
        const int64_t n = p->delta > 0 ? p->delta : p->max_seq_len;
        if (!(d > 128 || (d > 64 && n >= 2048 && p->max_attn_len == 0))) return -1;
    }
    if (p->dtype == TF_BF16) return (int)dispatch<__nv_bfloat16>(*p, (cudaStream_t)stream);
    return (int)dispatch<__half>(*p, (cudaStream_t)stream);
#else
    (void)p;
    (void)stream;
    return -1;
#endif
}
