/* HSTU attention forward on CUDA (semantics: hstu_kernels.h).
 *
 * Tensor-core kernel (bf16 / fp16), FlashAttention-2 structure without the softmax bookkeeping: one
 * block of 8 warps per (sequence, head, tile of BM = 128 query rows); each warp owns 16 query rows.
 * The block walks the K/V tiles (BN keys) that tf_hstu_col_range() says its rows can reach, double
 * buffered with cp.async; per tile each warp computes S = Q K^T (mma.sync m16n8k16, fp32 accumulate,
 * Q and K fragments by ldmatrix from padded shared memory), P = SiLU(alpha (S + bias)) / S_norm in
 * registers (SiLU by one tanh.approx: the special-function unit, not the tensor cores, would otherwise
 * bound the loop), the mask evaluated only in tiles tf_hstu_tile_full() does not clear, and O += P V with P
 * repacked from the accumulators as the A operand. O stays in registers and is written once.
 * Head dims are padded to the template D (64, 128, 256); k-steps and output columns beyond the real
 * Dqk / Dv are skipped at run time. Jagged scheduling: the linear block index runs over (query tile,
 * sequence, head) with the highest tile first, so the tiles with the most keys start first and the
 * blocks of short sequences (which exit at once past their end) fill in behind them.
 *
 * Dropout (DROP, a separate instantiation so the kernel without it is unchanged): P's elements are
 * multiplied by their factor (tf_hstu_drop_pair: a thread's two adjacent columns share one Philox block)
 * before P V. tf_hstu_fwd_cuda sends dropout here on every GPU (the sm_90a kernel has no dropout form).
 *
 * fp32 kernel: one warp per (query row, head), lanes across the head dims; plain FMA, for correctness. */
#include <cuda_runtime.h>

#include "hstu_mma.cuh"

namespace {

constexpr int kFwdWarps = 8, kFwdBM = 16 * kFwdWarps, kFwdThreads = 32 * kFwdWarps;

template <int D>
struct FwdCfg {
    static constexpr int BN = D >= 256 ? 32 : 64;
    static constexpr int LDS = D + 8;  // padded row: ldmatrix rows fall in different banks
    static constexpr int SMEM = (kFwdBM + 4 * BN) * LDS * 2;
    static constexpr int MIN_BLOCKS = D >= 256 ? 1 : 2;  // two blocks (16 warps) per SM up to D = 128
};

template <typename T, int D, bool DROP>
__global__ void __launch_bounds__(kFwdThreads, FwdCfg<D>::MIN_BLOCKS) hstu_fwd_mma(const tf_hstu_params p, int q_tiles) {
    constexpr int BM = kFwdBM, BN = FwdCfg<D>::BN, LDS = FwdCfg<D>::LDS;
    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t *Qs = smem, *Ks = smem + BM * LDS, *Vs = Ks + 2 * BN * LDS;

    const int64_t BH = p.B * p.H;
    const int tile = q_tiles - 1 - (int)(blockIdx.x / BH);
    const int64_t b = (blockIdx.x % BH) / p.H;
    const int h = (int)(blockIdx.x % p.H);
    const HstuSeq s = hstu_seq(p, b);
    const int i0 = tile * BM;  // first query row of the tile (index into this sequence's query rows)
    if (i0 >= s.nq) return;
    const int pos0 = s.n - s.nq + i0;  // its position in the sequence (negative: cached rows before it)
    const int p0 = pos0 > 0 ? pos0 : 0, p1 = min(pos0 + BM, s.n);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const int rows_here = min(BM, s.nq - i0);
    const int dqk = (int)p.dqk, dv = (int)p.dv;
    const float alpha = (float)p.alpha, inv_scale = (float)p.inv_scale;
    uint64_t dseed = 0, doff = 0;
    if constexpr (DROP) tf_philox_resolve(&p.philox, &dseed, &doff);
    const float drop_p = (float)p.dropout_p, drop_scale = 1.f / (1.f - drop_p);

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    int kt_lo = 0, kt_hi = -1;
    if (p0 < p1) {
        int lo, hi;
        tf_hstu_col_range(&s.mask, p0, p1, &lo, &hi);
        kt_lo = lo / BN;
        kt_hi = hi / BN;
    }
    if (kt_lo <= kt_hi) {
        load_tile<BM, D, LDS, kFwdThreads>(Qs, p.q, p.q_sr, p.q_sh, s.q_start + i0, -min(pos0, 0), rows_here, h,
                                           dqk);
        auto load_kv = [&](int kt, int buf) {
            const int k0 = kt * BN, nk = min(BN, s.n - k0);
            load_tile<BN, D, LDS, kFwdThreads>(Ks + buf * BN * LDS, p.k, p.k_sr, p.k_sh, s.start + k0, 0, nk, h, dqk);
            load_tile<BN, D, LDS, kFwdThreads>(Vs + buf * BN * LDS, p.v, p.v_sr, p.v_sh, s.start + k0, 0, nk, h, dv);
        };
        load_kv(kt_lo, 0);
        cp_async_commit();
        const int qrow = warp * 16;  // this warp's first row in the tile
        for (int kt = kt_lo; kt <= kt_hi; ++kt) {
            const int buf = (kt - kt_lo) & 1;
            if (kt < kt_hi) load_kv(kt + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            const uint16_t *Kb = Ks + buf * BN * LDS, *Vb = Vs + buf * BN * LDS;

            float sacc[BN / 8][4];
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) sacc[i][0] = sacc[i][1] = sacc[i][2] = sacc[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                if (kk * 16 >= dqk) break;
                uint32_t a[4];
                ldsm_x4(a, Qs + (qrow + lane % 16) * LDS + kk * 16 + (lane / 16) * 8);
#pragma unroll
                for (int np = 0; np < BN / 16; ++np) {
                    uint32_t r[4];
                    ldsm_x4(r, Kb + (np * 16 + (lane / 16) * 8 + lane % 8) * LDS + kk * 16 + ((lane / 8) % 2) * 8);
                    mma16816<T>(sacc[2 * np], a, r[0], r[1]);
                    mma16816<T>(sacc[2 * np + 1], a, r[2], r[3]);
                }
            }
            const int k0 = kt * BN;
            // Tiles inside the mask with no bias take the short path; boundary tiles test each pair.
            if (tf_hstu_tile_full(&s.mask, pos0, pos0 + BM, k0, k0 + BN) && !p.bias) {
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sacc[nt][e] = silu_scaled(alpha * sacc[nt][e], inv_scale);
            } else {
                const uint32_t rows_in[2] = {hstu_row_bits<BN / 8>(s.mask, pos0 + qrow + g, k0 + 2 * t4),
                                             hstu_row_bits<BN / 8>(s.mask, pos0 + qrow + g + 8, k0 + 2 * t4)};
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int pos = pos0 + qrow + g + (e >= 2 ? 8 : 0), key = k0 + nt * 8 + 2 * t4 + (e & 1);
                        const bool in = (rows_in[e >> 1] >> (2 * nt + (e & 1))) & 1u;
                        float x = sacc[nt][e];
                        if (p.bias && in)
                            x += tf_bias_load(p.bias, p.bias_dtype,
                                              b * p.bias_sb + h * p.bias_sh + (int64_t)pos * p.bias_sr + key);
                        sacc[nt][e] = in ? silu_scaled(alpha * x, inv_scale) : 0.f;
                    }
                }
            }
            if constexpr (DROP) {
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int64_t row = s.start + pos0 + qrow + g + 8 * hh;  // full form: q row = k row
                        float f0, f1;
                        const int key = k0 + nt * 8 + 2 * t4;
                        tf_hstu_drop_pair(dseed, doff, tf_hstu_drop_index(row, h, p.H, p.max_seq_len, key), drop_p,
                                          drop_scale, &f0, &f1);
                        sacc[nt][2 * hh] *= f0;
                        sacc[nt][2 * hh + 1] *= f1;
                    }
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const uint32_t a[4] = {pack2<T>(sacc[2 * kk][0], sacc[2 * kk][1]),
                                       pack2<T>(sacc[2 * kk][2], sacc[2 * kk][3]),
                                       pack2<T>(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]),
                                       pack2<T>(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3])};
#pragma unroll
                for (int np = 0; np < D / 16; ++np) {
                    if (np * 16 >= dv) break;
                    uint32_t r[4];
                    ldsm_x4_t(r, Vb + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LDS + np * 16 + (lane / 16) * 8);
                    mma16816<T>(o[2 * np], a, r[0], r[1]);
                    mma16816<T>(o[2 * np + 1], a, r[2], r[3]);
                }
            }
            __syncthreads();  // the buffer is refilled by the next iteration's prefetch
        }
    }
    // write O (zeros for rows no key reaches)
    T *out = (T *)p.o;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + g + half * 8;
        if (r >= rows_here) continue;
        T *orow = out + ((s.q_start + i0 + r) * p.H + h) * (int64_t)dv;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int col = nt * 8 + 2 * t4;
            if (col < dv) *(uint32_t *)(orow + col) = pack2<T>(o[nt][2 * half], o[nt][2 * half + 1]);
        }
    }
}

/* fp32: one warp per (query row, head); lanes split the head dims (up to 8 each). */
template <bool DROP>
__global__ void hstu_fwd_f32(const tf_hstu_params p, int64_t q_rows) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int h = blockIdx.y, lane = threadIdx.x % 32;
    if (row >= q_rows || p.B == 0) return;  /* no sequence: the output was zeroed */
    int64_t b;
    if (p.delta > 0) {
        b = row / p.delta;
    } else {  // the sequence holding this row: last b with offsets[b] <= row
        int64_t lo = 0, hi = p.B;  // offsets[lo] <= row < offsets[hi] when row is covered
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (tf_idx_load(p.offsets, p.offsets_i64, mid) <= row) lo = mid; else hi = mid;
        }
        b = lo;
    }
    const HstuSeq s = hstu_seq(p, b);
    const int i = (int)(row - s.q_start), pos = s.n - s.nq + i;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const float *q = (const float *)p.q + row * p.q_sr + h * p.q_sh;
    const bool covered = p.delta > 0 || (row >= s.start && i < s.n);
    uint64_t dseed = 0, doff = 0;  // DROP: the full form only (the glue refuses dropout with delta)
    if constexpr (DROP) tf_philox_resolve(&p.philox, &dseed, &doff);
    const float drop_p = (float)p.dropout_p, drop_scale = 1.f / (1.f - drop_p);
    if (covered && pos >= 0) {
        int lo, hi;
        tf_hstu_col_range(&s.mask, pos, pos + 1, &lo, &hi);
        for (int key = lo; key <= hi; ++key) {
            if (!tf_hstu_valid(&s.mask, pos, key)) continue;
            const float *k = (const float *)p.k + (s.start + key) * p.k_sr + h * p.k_sh;
            float d = 0.f;
            for (int j = lane; j < p.dqk; j += 32) d += q[j] * k[j];
            for (int off = 16; off; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
            if (p.bias) d += tf_bias_load(p.bias, p.bias_dtype, b * p.bias_sb + h * p.bias_sh + (int64_t)pos * p.bias_sr + key);
            float w = silu_of((float)p.alpha * d) * (float)p.inv_scale;
            if constexpr (DROP)
                w *= tf_hstu_drop_factor(dseed, doff, tf_hstu_drop_index(row, h, p.H, p.max_seq_len, key), drop_p,
                                         drop_scale);
            const float *v = (const float *)p.v + (s.start + key) * p.v_sr + h * p.v_sh;
#pragma unroll
            for (int c = 0; c < 8; ++c)
                if (lane + 32 * c < p.dv) acc[c] += w * v[lane + 32 * c];
        }
    }
    float *o = (float *)p.o + (row * p.H + h) * p.dv;
#pragma unroll
    for (int c = 0; c < 8; ++c)
        if (lane + 32 * c < p.dv && covered) o[lane + 32 * c] = acc[c];
}

template <typename T, int D, bool DROP>
cudaError_t launch_fwd(const tf_hstu_params &p, cudaStream_t stream) {
    const HstuFwdGrid g = hstu_fwd_grid(p, kFwdBM);
    if (g.err != cudaSuccess || g.blocks == 0) return g.err;
    constexpr int smem = FwdCfg<D>::SMEM;
    cudaError_t err =
        cudaFuncSetAttribute(hstu_fwd_mma<T, D, DROP>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    hstu_fwd_mma<T, D, DROP><<<(unsigned)g.blocks, kFwdThreads, smem, stream>>>(p, g.q_tiles);
    return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_fwd(const tf_hstu_params &p, cudaStream_t stream) {
    if (p.dropout_p > 0 && p.delta == 0)
        return hstu_with_head_dim(p, [&](auto D) { return launch_fwd<T, decltype(D)::value, true>(p, stream); });
    return hstu_with_head_dim(p, [&](auto D) { return launch_fwd<T, decltype(D)::value, false>(p, stream); });
}


/* Rows outside the sequences, zeroed: one thread per 4 bytes, grid-striding over the rows before
 * offsets[0] and from offsets[B] on, for up to three tensors (blockIdx.y). Usually both ranges are empty
 * and every thread returns after two loads. */
struct ZeroOutside {
    uint32_t *rows[3];
    int64_t words[3], stride[3];  // 4-byte words per row, and between rows
};

__global__ void hstu_zero_outside(ZeroOutside z, int64_t L, const void *offsets, int offsets_i64, int64_t B) {
    int64_t a = tf_idx_load(offsets, offsets_i64, 0), e = tf_idx_load(offsets, offsets_i64, B);
    a = a < 0 ? 0 : a > L ? L : a;
    e = e < a ? a : e > L ? L : e;
    const int64_t w = z.words[blockIdx.y], s = z.stride[blockIdx.y], total = (a + L - e) * w;
    uint32_t *base = z.rows[blockIdx.y];
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t k = i / w, r = k < a ? k : e + (k - a);  // the k-th uncovered row
        base[r * s + (i - k * w)] = 0u;
    }
}

}  // namespace

extern "C" int tf_hstu_fwd_cuda(const tf_hstu_params *p, void *stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    if (p->decode_ws) return tf_hstu_decode_cuda(p, stream_);
    const int sm90 = p->dropout_p > 0 && p->delta == 0 ? -1 : tf_hstu_fwd_sm90(p, stream_);
    if (sm90 >= 0) return sm90;
    if (p->dtype == TF_BF16) return (int)dispatch_fwd<__nv_bfloat16>(*p, stream);
    if (p->dtype == TF_F16) return (int)dispatch_fwd<__half>(*p, stream);
    const int64_t q_rows = p->delta > 0 ? p->B * p->delta : p->L;
    if (q_rows == 0 || p->H == 0) return 0;
    const dim3 grid((unsigned)((q_rows + 3) / 4), (unsigned)p->H);
    if (p->dropout_p > 0 && p->delta == 0)
        hstu_fwd_f32<true><<<grid, 128, 0, stream>>>(*p, q_rows);
    else
        hstu_fwd_f32<false><<<grid, 128, 0, stream>>>(*p, q_rows);
    return (int)cudaGetLastError();
}

extern "C" int tf_hstu_zero_outside(void *const *rows, const int64_t *row_bytes, const int64_t *row_stride_bytes, int n,
                                    int64_t L, const void *offsets, int offsets_i64, int64_t B, void *stream) {
    if (n <= 0 || L == 0) return 0;
    if (n > 3) return (int)cudaErrorInvalidValue;
    ZeroOutside z = {};
    for (int i = 0; i < n; ++i) {
        if (row_bytes[i] % 4 != 0 || row_stride_bytes[i] % 4 != 0 || (uintptr_t)rows[i] % 4 != 0)
            return (int)cudaErrorInvalidValue;
        z.rows[i] = (uint32_t *)rows[i];
        z.words[i] = row_bytes[i] / 4;
        z.stride[i] = row_stride_bytes[i] / 4;
    }
    // a small fixed grid: the common case has nothing to zero, and a launch this size costs what a
    // memset's does; all-uncovered calls (rare) stride over their rows
    hstu_zero_outside<<<dim3(128, (unsigned)n), 256, 0, (cudaStream_t)stream>>>(z, L, offsets, offsets_i64, B);
    return (int)cudaGetLastError();
}
