/* HSTU attention backward on CUDA (semantics: hstu_kernels.h). tf_hstu_bwd_cuda first offers the call to the
 * sm_90a wgmma kernel (hstu_bwd_sm90.cu: compute capability 9.0, 16-bit, head dims up to 256, no
 * attn_bias); the kernels here run everywhere else.
 *
 * Tensor-core kernel (bf16 / fp16), FlashAttention-2 backward structure: one block of 8 warps per
 * (sequence, head, tile of BN keys: 128, or 64 at head dim 256). K and V of the tile stay in shared memory; the block walks the query tiles
 * (BM rows) that tf_hstu_row_range() says can see these keys (context rows first, then the causal
 * range), double-buffering Q and dO with cp.async. Each warp owns 16 keys (and, at head dim 256, half
 * of the head-dim columns: two warps share a key slab) and computes, transposed so that keys are
 * accumulator rows:
 *   S^T = K Q^T, dP^T = V dO^T                  (mma.sync m16n8k16, fp32 accumulate)
 *   P^T = SiLU(z) / S_norm, dZ^T = dP^T / S_norm * s (1 + z (1 - s)) * alpha, masked in boundary tiles
 *   dV += P^T dO, dK += dZ^T Q                  (registers, written once at the end)
 * dZ goes through shared memory (bf16/fp16) and every warp then computes a 16-row x 64-column piece
 * of dQ = dZ K (up to 64 columns a pass), added with fp32 atomics into an fp32 buffer that the caller casts to q's dtype.
 * d(attn_bias) = dZ by fp32 atomics (summed over heads when the bias has one head).
 * Jagged scheduling: blocks ordered by key tile, lowest first (the most query tiles to visit), then
 * sequence and head; blocks past the end of their sequence exit at once.
 *
 * Dropout (DROP, a separate instantiation so the kernel without it is unchanged): P^T and dZ^T are
 * multiplied by the forward's factors, regenerated from Philox (one block per element: a thread's
 * elements of one key are rows apart), before dbias, dV and dK take them. tf_hstu_bwd_cuda sends dropout
 * here on every GPU.
 *
 * fp32 kernels: one warp per (row, head) for dQ and one per (key, head) for dK, dV, dbias; plain FMA. */
#include <cuda_runtime.h>

#include "hstu_mma.cuh"

namespace {

template <int D>
struct BwdCfg {
    static constexpr int NW = 8;                     // warps
    static constexpr int DSPLIT = D >= 256 ? 2 : 1;  // warps sharing one 16-key slab
    static constexpr int BM = D >= 256 ? 32 : 64;    // query rows per step
    static constexpr int BN = 16 * NW / DSPLIT;      // keys per block
    static constexpr int LDS = D + 8, LDSS = BN + 8;
    static constexpr int SMEM = (2 * BN * LDS + 4 * BM * LDS + BM * LDSS) * 2;
    static constexpr int SLABS = BM / 16, PARTS = NW / SLABS, PC = D / PARTS;  // dQ work split
    static constexpr int CW = PC < 64 ? PC : 64;                               // dQ columns per pass
};

template <typename T>
__device__ __forceinline__ uint16_t to_bits(float x);
template <>
__device__ __forceinline__ uint16_t to_bits<__nv_bfloat16>(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
template <>
__device__ __forceinline__ uint16_t to_bits<__half>(float x) {
    return __half_as_ushort(__float2half_rn(x));
}

template <typename T, int D, bool DROP>
__global__ void __launch_bounds__(32 * BwdCfg<D>::NW) hstu_bwd_mma(const tf_hstu_params p, int k_tiles) {
    using C = BwdCfg<D>;
    constexpr int NW = C::NW, NT = 32 * NW, BM = C::BM, BN = C::BN, LDS = C::LDS, LDSS = C::LDSS;
    constexpr int DP = D / C::DSPLIT;
    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t *Ks = smem, *Vs = Ks + BN * LDS, *Qs = Vs + BN * LDS, *Os = Qs + 2 * BM * LDS,
             *Ss = Os + 2 * BM * LDS;

    const int64_t BH = p.B * p.H;
    const int kt = (int)(blockIdx.x / BH);
    const int64_t b = (blockIdx.x % BH) / p.H;
    const int h = (int)(blockIdx.x % p.H);
    const HstuSeq s = hstu_seq(p, b);
    const int k0 = kt * BN;
    if (k0 >= s.n) return;
    const int nk = min(BN, s.n - k0);
    const int dqk = (int)p.dqk, dv = (int)p.dv;
    const float alpha = (float)p.alpha, inv_scale = (float)p.inv_scale;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const int ks = warp / C::DSPLIT, dpart = warp % C::DSPLIT;
    uint64_t dseed = 0, doff = 0;
    if constexpr (DROP) tf_philox_resolve(&p.philox, &dseed, &doff);
    const float drop_p = (float)p.dropout_p, drop_scale = 1.f / (1.f - drop_p);
    // dropout's factor of (query position pos, key): the forward's
    auto drop_at = [&](int pos, int key) {
        return tf_hstu_drop_factor(dseed, doff, tf_hstu_drop_index(s.start + pos, h, p.H, p.max_seq_len, key), drop_p,
                                   drop_scale);
    };

    int ctx_end, lo, hi;
    tf_hstu_row_range(&s.mask, k0, k0 + nk, &ctx_end, &lo, &hi);
    const int lo_t = lo / BM, hi_t = hi / BM;
    const int nctx = min((ctx_end + BM - 1) / BM, lo_t);
    const int total = nctx + max(0, hi_t - lo_t + 1);
    auto q_tile = [&](int it) { return it < nctx ? it : lo_t + it - nctx; };
    auto load_qo = [&](int it, int buf) {
        const int q0 = q_tile(it) * BM, nr = min(BM, s.n - q0);
        load_tile<BM, D, LDS, NT>(Qs + buf * BM * LDS, p.q, p.q_sr, p.q_sh, s.start + q0, 0, nr, h, dqk);
        load_tile<BM, D, LDS, NT>(Os + buf * BM * LDS, p.dout, p.do_sr, p.do_sh, s.start + q0, 0, nr, h, dv);
    };

    float dk[DP / 8][4], dvacc[DP / 8][4];
#pragma unroll
    for (int i = 0; i < DP / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][e] = dvacc[i][e] = 0.f;

    load_tile<BN, D, LDS, NT>(Ks, p.k, p.k_sr, p.k_sh, s.start + k0, 0, nk, h, dqk);
    load_tile<BN, D, LDS, NT>(Vs, p.v, p.v_sr, p.v_sh, s.start + k0, 0, nk, h, dv);
    if (total > 0) load_qo(0, 0);
    cp_async_commit();

    for (int it = 0; it < total; ++it) {
        const int buf = it & 1, q0 = q_tile(it) * BM;
        if (it + 1 < total) load_qo(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const uint16_t *Qb = Qs + buf * BM * LDS, *Ob = Os + buf * BM * LDS;

        float st[BM / 8][4], dpt[BM / 8][4];
#pragma unroll
        for (int i = 0; i < BM / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            if (kk * 16 >= dqk) break;
            uint32_t a[4];
            ldsm_x4(a, Ks + (ks * 16 + lane % 16) * LDS + kk * 16 + (lane / 16) * 8);
#pragma unroll
            for (int np = 0; np < BM / 16; ++np) {
                uint32_t r[4];
                ldsm_x4(r, Qb + (np * 16 + (lane / 16) * 8 + lane % 8) * LDS + kk * 16 + ((lane / 8) % 2) * 8);
                mma16816<T>(st[2 * np], a, r[0], r[1]);
                mma16816<T>(st[2 * np + 1], a, r[2], r[3]);
            }
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            if (kk * 16 >= dv) break;
            uint32_t a[4];
            ldsm_x4(a, Vs + (ks * 16 + lane % 16) * LDS + kk * 16 + (lane / 16) * 8);
#pragma unroll
            for (int np = 0; np < BM / 16; ++np) {
                uint32_t r[4];
                ldsm_x4(r, Ob + (np * 16 + (lane / 16) * 8 + lane % 8) * LDS + kk * 16 + ((lane / 8) % 2) * 8);
                mma16816<T>(dpt[2 * np], a, r[0], r[1]);
                mma16816<T>(dpt[2 * np + 1], a, r[2], r[3]);
            }
        }
        // Tiles inside the mask with no bias take the short path; boundary tiles test each pair.
        if (tf_hstu_tile_full(&s.mask, q0, q0 + BM, k0, k0 + BN) && !p.bias) {
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float z = alpha * st[nt][e], sg = sigmoid_fast(z);
                    st[nt][e] = z * sg * inv_scale;
                    dpt[nt][e] *= inv_scale * alpha * sg * fmaf(z, 1.f - sg, 1.f);
                    if constexpr (DROP) {
                        const float f = drop_at(q0 + nt * 8 + 2 * t4 + (e & 1), k0 + ks * 16 + g + (e >= 2 ? 8 : 0));
                        st[nt][e] *= f;
                        dpt[nt][e] *= f;
                    }
                }
        } else {
            float *dbias = (float *)p.dbias;
            const uint32_t keys_in[2] = {hstu_col_bits<BM / 8>(s.mask, k0 + ks * 16 + g, q0 + 2 * t4),
                                         hstu_col_bits<BM / 8>(s.mask, k0 + ks * 16 + g + 8, q0 + 2 * t4)};
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + ks * 16 + g + (e >= 2 ? 8 : 0), pos = q0 + nt * 8 + 2 * t4 + (e & 1);
                    const bool in = (keys_in[e >> 1] >> (2 * nt + (e & 1))) & 1u;
                    const int64_t bidx = b * p.bias_sb + h * p.bias_sh + (int64_t)pos * p.bias_sr + key;
                    float x = st[nt][e];
                    if (p.bias && in) x += tf_bias_load(p.bias, p.bias_dtype, bidx);
                    const float z = alpha * x, sg = sigmoid_fast(z);
                    float dz = dpt[nt][e] * inv_scale * alpha * sg * fmaf(z, 1.f - sg, 1.f);
                    float pw = z * sg * inv_scale;
                    if constexpr (DROP) {
                        const float f = drop_at(pos, key);
                        dz *= f;
                        pw *= f;
                    }
                    st[nt][e] = in ? pw : 0.f;
                    dpt[nt][e] = in ? dz : 0.f;
                    if (dbias && in && dpart == 0) atomicAdd(dbias + bidx, dz);
                }
            }
        }
        // dV += P^T dO and dK += dZ^T Q, this warp's head-dim columns [dpart * DP, + DP)
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            const uint32_t ap[4] = {pack2<T>(st[2 * kk][0], st[2 * kk][1]), pack2<T>(st[2 * kk][2], st[2 * kk][3]),
                                    pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                    pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
            const uint32_t az[4] = {pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]),
                                    pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]),
                                    pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                    pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
            const int row = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
#pragma unroll
            for (int np = 0; np < DP / 16; ++np) {
                const int col = dpart * DP + np * 16;
                uint32_t r[4];
                if (col < dv) {
                    ldsm_x4_t(r, Ob + row * LDS + col + (lane / 16) * 8);
                    mma16816<T>(dvacc[2 * np], ap, r[0], r[1]);
                    mma16816<T>(dvacc[2 * np + 1], ap, r[2], r[3]);
                }
                if (col < dqk) {
                    ldsm_x4_t(r, Qb + row * LDS + col + (lane / 16) * 8);
                    mma16816<T>(dk[2 * np], az, r[0], r[1]);
                    mma16816<T>(dk[2 * np + 1], az, r[2], r[3]);
                }
            }
        }
        // dZ -> shared memory as [query][key], for dQ = dZ K
        if (dpart == 0) {
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    Ss[(nt * 8 + 2 * t4 + (e & 1)) * LDSS + ks * 16 + g + (e >= 2 ? 8 : 0)] = to_bits<T>(dpt[nt][e]);
        }
        __syncthreads();
        {
            const int qs = warp % C::SLABS, part = warp / C::SLABS;
#pragma unroll
            for (int c0 = part * C::PC; c0 < part * C::PC + C::PC; c0 += C::CW) {
                if (c0 >= dqk) break;
                float acc[C::CW / 8][4];
#pragma unroll
                for (int i = 0; i < C::CW / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    uint32_t a[4];
                    ldsm_x4(a, Ss + (qs * 16 + lane % 16) * LDSS + kk * 16 + (lane / 16) * 8);
#pragma unroll
                    for (int np = 0; np < C::CW / 16; ++np) {
                        if (c0 + np * 16 >= dqk) break;
                        uint32_t r[4];
                        ldsm_x4_t(r, Ks + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LDS + c0 + np * 16 +
                                         (lane / 16) * 8);
                        mma16816<T>(acc[2 * np], a, r[0], r[1]);
                        mma16816<T>(acc[2 * np + 1], a, r[2], r[3]);
                    }
                }
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int pos = q0 + qs * 16 + g + half * 8;
                    if (pos >= s.n) continue;
                    float *dst = p.dq_acc + ((s.start + pos) * p.H + h) * (int64_t)dqk;
#pragma unroll
                    for (int nt = 0; nt < C::CW / 8; ++nt) {
                        const int col = c0 + nt * 8 + 2 * t4;
                        if (col < dqk) {
                            atomicAdd(dst + col, acc[nt][2 * half]);
                            atomicAdd(dst + col + 1, acc[nt][2 * half + 1]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // Ss and this Q/dO buffer are rewritten next
    }
    cp_async_wait<0>();
    // dK, dV of this warp's 16 keys and columns
    T *dkp = (T *)p.dk, *dvp = (T *)p.dvv;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = k0 + ks * 16 + g + half * 8;
        if (key >= s.n) continue;
        T *dkr = dkp + (s.start + key) * p.dk_sr + h * dqk, *dvr = dvp + (s.start + key) * p.dv_sr + h * dv;
#pragma unroll
        for (int nt = 0; nt < DP / 8; ++nt) {
            const int col = dpart * DP + nt * 8 + 2 * t4;
            if (col < dqk) *(uint32_t *)(dkr + col) = pack2<T>(dk[nt][2 * half], dk[nt][2 * half + 1]);
            if (col < dv) *(uint32_t *)(dvr + col) = pack2<T>(dvacc[nt][2 * half], dvacc[nt][2 * half + 1]);
        }
    }
}

/* The sequence of k/v row `row` (full form); returns false when no sequence holds it. */
__device__ __forceinline__ bool seq_of_row(const tf_hstu_params &p, int64_t row, int64_t *b) {
    if (p.B == 0) return false;
    int64_t lo = 0, hi = p.B;
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (tf_idx_load(p.offsets, p.offsets_i64, mid) <= row) lo = mid; else hi = mid;
    }
    *b = lo;
    return row >= tf_idx_load(p.offsets, p.offsets_i64, lo) && row < tf_idx_load(p.offsets, p.offsets_i64, lo + 1);
}

__device__ __forceinline__ float warp_dot(const float *a, const float *b, int d, int lane) {
    float s = 0.f;
    for (int j = lane; j < d; j += 32) s += a[j] * b[j];
    for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}

/* fp32 dQ: one warp per (row, head); writes p.dq_acc. */
template <bool DROP>
__global__ void hstu_bwd_dq_f32(const tf_hstu_params p) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int h = blockIdx.y, lane = threadIdx.x % 32;
    int64_t b;
    if (row >= p.L || !seq_of_row(p, row, &b)) return;
    const HstuSeq s = hstu_seq(p, b);
    const int64_t rel = row - s.start;
    if (rel < 0 || rel >= s.n) return;  /* unvalidated offsets only: the row is past the clamped sequence */
    const int pos = (int)rel;
    const float *q = (const float *)p.q + row * p.q_sr + h * p.q_sh;
    const float *dout = (const float *)p.dout + row * p.do_sr + h * p.do_sh;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint64_t dseed = 0, doff = 0;
    if constexpr (DROP) tf_philox_resolve(&p.philox, &dseed, &doff);
    const float drop_p = (float)p.dropout_p, drop_scale = 1.f / (1.f - drop_p);
    int lo, hi;
    tf_hstu_col_range(&s.mask, pos, pos + 1, &lo, &hi);
    for (int key = lo; key <= hi; ++key) {
        if (!tf_hstu_valid(&s.mask, pos, key)) continue;
        const float *k = (const float *)p.k + (s.start + key) * p.k_sr + h * p.k_sh;
        const float *v = (const float *)p.v + (s.start + key) * p.v_sr + h * p.v_sh;
        float x = warp_dot(q, k, (int)p.dqk, lane);
        if (p.bias) x += tf_bias_load(p.bias, p.bias_dtype, b * p.bias_sb + h * p.bias_sh + (int64_t)pos * p.bias_sr + key);
        const float z = (float)p.alpha * x, sg = 1.f / (1.f + expf(-z));
        float dz = warp_dot(dout, v, (int)p.dv, lane) * (float)p.inv_scale * sg * (1.f + z * (1.f - sg)) *
                   (float)p.alpha;
        if constexpr (DROP)
            dz *= tf_hstu_drop_factor(dseed, doff, tf_hstu_drop_index(row, h, p.H, p.max_seq_len, key), drop_p,
                                      drop_scale);
#pragma unroll
        for (int c = 0; c < 8; ++c)
            if (lane + 32 * c < p.dqk) acc[c] += dz * k[lane + 32 * c];
    }
    float *dq = p.dq_acc + (row * p.H + h) * p.dqk;
#pragma unroll
    for (int c = 0; c < 8; ++c)
        if (lane + 32 * c < p.dqk) dq[lane + 32 * c] = acc[c];
}

/* fp32 dK, dV (and dbias): one warp per (key row, head). */
template <bool DROP>
__global__ void hstu_bwd_dkv_f32(const tf_hstu_params p) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int h = blockIdx.y, lane = threadIdx.x % 32;
    int64_t b;
    if (row >= p.L || !seq_of_row(p, row, &b)) return;
    const HstuSeq s = hstu_seq(p, b);
    const int64_t rel = row - s.start;
    /* unvalidated offsets only: a row past the clamped sequence gets zero gradients */
    const bool in_seq = rel >= 0 && rel < s.n;
    const int key = in_seq ? (int)rel : 0;
    const float *k = (const float *)p.k + row * p.k_sr + h * p.k_sh;
    const float *v = (const float *)p.v + row * p.v_sr + h * p.v_sh;
    float dka[8] = {0, 0, 0, 0, 0, 0, 0, 0}, dva[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint64_t dseed = 0, doff = 0;
    if constexpr (DROP) tf_philox_resolve(&p.philox, &dseed, &doff);
    const float drop_p = (float)p.dropout_p, drop_scale = 1.f / (1.f - drop_p);
    int ctx_end, lo, hi;
    tf_hstu_row_range(&s.mask, key, key + 1, &ctx_end, &lo, &hi);
    for (int pos = 0; in_seq && pos <= hi; ++pos) {
        if (pos >= ctx_end && pos < lo) pos = lo;
        if (!tf_hstu_valid(&s.mask, pos, key)) continue;
        const float *q = (const float *)p.q + (s.start + pos) * p.q_sr + h * p.q_sh;
        const float *dout = (const float *)p.dout + (s.start + pos) * p.do_sr + h * p.do_sh;
        const int64_t bidx = b * p.bias_sb + h * p.bias_sh + (int64_t)pos * p.bias_sr + key;
        float x = warp_dot(q, k, (int)p.dqk, lane);
        if (p.bias) x += tf_bias_load(p.bias, p.bias_dtype, bidx);
        const float z = (float)p.alpha * x, sg = 1.f / (1.f + expf(-z));
        const float f = DROP ? tf_hstu_drop_factor(dseed, doff, tf_hstu_drop_index(s.start + pos, h, p.H,
                                                                                   p.max_seq_len, key),
                                                    drop_p, drop_scale)
                             : 1.f;
        const float pw = z * sg * (float)p.inv_scale * f;
        const float dz = warp_dot(dout, v, (int)p.dv, lane) * (float)p.inv_scale * sg * (1.f + z * (1.f - sg)) *
                         (float)p.alpha * f;
        if (p.dbias && lane == 0) atomicAdd((float *)p.dbias + bidx, dz);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            if (lane + 32 * c < p.dqk) dka[c] += dz * q[lane + 32 * c];
            if (lane + 32 * c < p.dv) dva[c] += pw * dout[lane + 32 * c];
        }
    }
    float *dk = (float *)p.dk + row * p.dk_sr + h * p.dqk, *dvv = (float *)p.dvv + row * p.dv_sr + h * p.dv;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        if (lane + 32 * c < p.dqk) dk[lane + 32 * c] = dka[c];
        if (lane + 32 * c < p.dv) dvv[lane + 32 * c] = dva[c];
    }
}

template <typename T, int D, bool DROP>
cudaError_t launch_bwd(const tf_hstu_params &p, cudaStream_t stream) {
    using C = BwdCfg<D>;
    const int k_tiles = (int)((p.max_seq_len + C::BN - 1) / C::BN);
    const int64_t blocks = (int64_t)k_tiles * p.B * p.H;
    if (blocks == 0) return cudaSuccess;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    cudaError_t err =
        cudaFuncSetAttribute(hstu_bwd_mma<T, D, DROP>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
    if (err != cudaSuccess) return err;
    hstu_bwd_mma<T, D, DROP><<<(unsigned)blocks, 32 * C::NW, C::SMEM, stream>>>(p, k_tiles);
    return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_bwd(const tf_hstu_params &p, cudaStream_t stream) {
    if (p.dropout_p > 0)
        return hstu_with_head_dim(p, [&](auto D) { return launch_bwd<T, decltype(D)::value, true>(p, stream); });
    return hstu_with_head_dim(p, [&](auto D) { return launch_bwd<T, decltype(D)::value, false>(p, stream); });
}

}  // namespace

extern "C" int tf_hstu_bwd_cuda(const tf_hstu_params *p, void *stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    const int sm90 = p->dropout_p > 0 ? -1 : tf_hstu_bwd_sm90(p, stream_);
    if (sm90 != -1) return sm90;
    if (p->dz) return (int)cudaErrorInvalidValue;  // set only where the two-part sm_90a backward applies
    if (p->dtype == TF_BF16) return (int)dispatch_bwd<__nv_bfloat16>(*p, stream);
    if (p->dtype == TF_F16) return (int)dispatch_bwd<__half>(*p, stream);
    if (p->L == 0 || p->H == 0) return 0;
    const dim3 grid((unsigned)((p->L + 3) / 4), (unsigned)p->H);
    if (p->dropout_p > 0) {
        hstu_bwd_dq_f32<true><<<grid, 128, 0, stream>>>(*p);
        hstu_bwd_dkv_f32<true><<<grid, 128, 0, stream>>>(*p);
    } else {
        hstu_bwd_dq_f32<false><<<grid, 128, 0, stream>>>(*p);
        hstu_bwd_dkv_f32<false><<<grid, 128, 0, stream>>>(*p);
    }
    return (int)cudaGetLastError();
}
