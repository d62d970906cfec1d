/* HSTU attention forward on Hopper (sm_90a): warp-specialized, TMA loads, warpgroup MMA (wgmma).
 *
 * Same semantics as hstu_fwd_mma (hstu_fwd.cu); work item = (query tile of BM = 128 rows, sequence,
 * head), whose key tiles tf_hstu_col_range() allows. Persistent: one block per SM takes items from a
 * global counter, longest first, and overlaps the next item's loads with this one's end. Per block:
 *   - warpgroup 0 produces: one warp takes the items, its first lane issues the copy engine's (TMA)
 *     tile loads: each item's Q tile into one of QB buffers, each K tile and each V tile into rings of
 *     their own (STK, STV stages), each completing on its stage's `full` mbarrier; the warpgroup hands
 *     most of its registers to the consumers (setmaxnreg);
 *   - warpgroups 1 and 2 consume 64 query rows each: S = Q K^T by wgmma m64nBNk16 with Q and K read
 *     by the tensor cores from shared memory, P = SiLU(...) masked in registers, O += P V with P from
 *     registers (S's fp32 accumulators repacked to 16 bits: mma.sync's A fragment shape) and V through
 *     the MN-major ("transposed") descriptor; then free the stages on their `empty` mbarriers. The two
 *     take turns (ping-pong, named barriers): one issues P V of tile j and S of tile j + 1 while the
 *     other runs its SiLU (with all 256 threads loading by cp.async and a __syncthreads per tile both
 *     SiLUs ran at once with the tensor cores idle: 302 against 358 TFLOP/s at 16x4096x128);
 *   - each consumer stages its O in its own rows of its item's Q buffer and the copy engine stores it
 *     (one TMA store per 64 columns), where the register stores took 10-15% of the consumers' time at
 *     1024-long sequences; rows the copy engine cannot store (a partial tile) take 16-byte stores
 *     after a transpose within each quad, or 4-byte stores where the rows are not 16-byte aligned;
 *   - tiles are 128-byte swizzled in shared memory (rows of 64 elements, 16-byte chunk index XOR row
 *     mod 8): what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and what the wgmma descriptors read;
 *   - items are ordered so that those sharing a (sequence, head)'s K and V run together (L2 reuse),
 *     longest tiles first within.
 * Built only for sm_90a (wgmma and setmaxnreg are not in plain sm_90). The entry point declines (and
 * hstu_fwd.cu's mma.sync kernel runs) off compute capability 9.0, where the copy engine cannot address
 * the tensors (strides not multiples of 16 bytes), for cached inference at head dims up to 128 unless
 * the backend is TF_HSTU_SM90, and for TF_HSTU_MMA. */
#include <cuda.h>  // CUtensorMap (the encoder is fetched from the driver at run time: no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "hstu_mma.cuh"
#include "tf_sm90.cuh"
#include "tf_wgmma.cuh"

namespace {

constexpr int kBM = 128;  // query rows per block: two consumer warpgroups of 64

template <int D>
struct Sm90Cfg {
    static constexpr int BN = D >= 256 ? 64 : 128;
    static constexpr int Q_BYTES = kBM * D * 2, KV_BYTES = BN * D * 2;
    // Q buffers: two up to D = 128, so the next item's Q loads during this one (not after its last S, nor
    // after the TMA store of O staged in the buffer has read it); at 256 a Q tile is 64 KB and there is one.
    static constexpr int QB = D <= 128 ? 2 : 1;
    // K and V in rings of their own: a K tile is free once both consumers' S = Q K^T of it are done, a
    // turn before its V tile (P V), so 2 K stages keep the lead that 3 joint K/V stages had, and the
    // 32 KB this frees at D = 128 holds the second Q buffer. As many stages as 227 KB of shared memory
    // allows (one block per SM).
    static constexpr int STK = D <= 64 ? 4 : 2;
    static constexpr int STV = D <= 64 ? 4 : D <= 128 ? 3 : 2;
    // +1024: the swizzle pattern repeats every 1024 bytes, so tiles start on a 1024-byte boundary
    static constexpr int SMEM = QB * Q_BYTES + (STK + STV) * KV_BYTES + 1024;
};

/* Validity of this thread's accumulator elements in a key tile: bit 2 j + e of bits[h] is row p + 8 h,
 * column key0 + 8 j + e (j < BN / 8, e < 2; key0 includes the thread's 2 t offset). From the rows'
 * spans: small code (a per-element mask test unrolled over a tile overflowed the instruction cache)
 * and cheap (the per-element test in a rolled loop made a boundary tile ~5x an interior one). */
template <int BN>
__device__ __forceinline__ void mask_bits(const tf_hstu_mask &m, int fast, int p, int key0, uint32_t (&bits)[2]) {
    if (fast == 1) {  // tf_hstu_causal(m), uniform per item: plain causal sequences skip the spans
        bits[0] = hstu_causal_row_bits<BN / 8>(m.n, p, key0);
        bits[1] = hstu_causal_row_bits<BN / 8>(m.n, p + 8, key0);
    } else if (fast == 2) {  // tf_hstu_band(m): a plain window, the band [p - m, p]
        bits[0] = hstu_band_row_bits<BN / 8>(m.n, m.m, p, key0);
        bits[1] = hstu_band_row_bits<BN / 8>(m.n, m.m, p + 8, key0);
    } else {
        bits[0] = hstu_row_bits<BN / 8>(m, p, key0);
        bits[1] = hstu_row_bits<BN / 8>(m, p + 8, key0);
    }
}
/* SiLU(z) for z = 2 h, h = c_t x (c_t = alpha / 2): z sigmoid(z) = h (1 + tanh h), one multiply, a tanh
 * and an FMA. P's 1 / S is not applied here: O takes it once, before its store. */
__device__ __forceinline__ __attribute__((unused)) float silu_h(float x, float c_t) {
    const float h = x * c_t;
    return fmaf(h, tanh_approx(h), h);
}
/* out of line: called from an unrolled loop, so the dtype switch is not copied per element */
__device__ __noinline__ __attribute__((unused)) float bias_at(const tf_hstu_params &p, int64_t b, int h, int pos, int key) {
    return tf_bias_load(p.bias, p.bias_dtype, b * p.bias_sb + h * p.bias_sh + (int64_t)pos * p.bias_sr + key);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* Zero rows [r0, BN) of a V tile (all panels) in shared memory, by one warpgroup, and make the zeros
 * visible to its wgmmas: TMA filled them from the next sequence, where P is 0 but 0 x inf is not. */
template <int D, int BN>
__device__ __forceinline__ void zero_tail_rows(uint8_t *tile, int r0, int cw) {
    const int chunks = (BN - r0) * 8;  // 16-byte chunks per panel
    for (int i = threadIdx.x % 128; i < chunks * (D / 64); i += 128) {
        const int c = i / chunks, x = i % chunks;
        *(uint4 *)(tile + c * BN * 128 + (r0 + x / 8) * 128 + (x % 8) * 16) = make_uint4(0, 0, 0, 0);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(3 + cw) : "memory");  // this warpgroup only (ids 1-2: free)
}
#endif

/* ---- a consumer warpgroup's share of a key tile (64 query rows) ---- */

/* P = SiLU(alpha (S + bias)) (O takes the 1 / S_norm), masked, from sacc into pa (16-bit A fragments). Interior tiles
 * skip the mask; boundary tiles get it as bits from a rolled loop (the mask and bias code unrolled over
 * every element made the kernel too big for the instruction cache: half its stalls were fetches).
 * wpos0: the warpgroup's first row position; k0: the tile's first key. */
template <typename T, int BN>
__device__ __forceinline__ void elementwise(float (&sacc)[BN / 2], uint32_t (&pa)[BN / 16][4], const tf_hstu_params &p,
                                            const tf_hstu_mask &mask, int fast, int64_t b, int h, int wpos0, int k0,
                                            float c_t) {
    const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const int prow = wpos0 + 16 * ((threadIdx.x / 32) % 4) + g;  // this thread's rows: prow, prow + 8
    if (tf_hstu_tile_full(&mask, wpos0, wpos0 + 64, k0, k0 + BN) && !p.bias) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) sacc[i] = silu_h(sacc[i], c_t);
    } else {
        uint32_t bits[2];
        mask_bits<BN>(mask, fast, prow, k0 + 2 * t4, bits);
        if (p.bias) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i)
                if (pair_bit(bits, i))
                    sacc[i] += bias_at(p, b, h, prow + ((i & 2) ? 8 : 0), k0 + (i / 4) * 8 + 2 * t4 + (i & 1));
        }
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) {
            // the mask as an AND with all ones or zero (selects made ptxas spill in the backward's tile loop)
            const uint32_t keep = 0u - (uint32_t)pair_bit(bits, i);
            sacc[i] = __uint_as_float(__float_as_uint(silu_h(sacc[i], c_t)) & keep);
        }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        const float *c0 = sacc + 8 * kk;  // accumulator chunks 2 kk (keys +0..7), 2 kk + 1 (+8..15)
        pa[kk][0] = pack2<T>(c0[0], c0[1]);
        pa[kk][1] = pack2<T>(c0[2], c0[3]);
        pa[kk][2] = pack2<T>(c0[4], c0[5]);
        pa[kk][3] = pack2<T>(c0[6], c0[7]);
    }
}
/* this thread's O rows (tile rows r0 + 16 warp + g (+ 8)) -> out, those below rows_here. vec: 16-byte
 * stores after a transpose within each quad (quad_chunk; the launch checks alignment and dv % 8): a warp
 * then writes 8 rows x 64 contiguous bytes per store, where the 4-byte stores of the accumulator layout
 * write 8 x 16 and half-fill every sector (in the backward those took 18% of the consumers' time). */
template <typename T, int D>
__device__ __forceinline__ void store_o(const float (&o)[D / 2], const tf_hstu_params &p, int64_t row0, int h,
                                        int r0, int rows_here, bool vec) {
    const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4, dv = (int)p.dv;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = r0 + 16 * ((threadIdx.x / 32) % 4) + g + 8 * half;
        T *orow = (T *)p.o + ((row0 + r) * p.H + h) * (int64_t)dv;
        if (vec) {
#pragma unroll
            for (int m = 0; m < D / 32; ++m) {
                const uint4 c = quad_chunk<T>(o, half, m);  // every lane: shuffles
                const int col = 8 * (4 * m + t4);
                if (r < rows_here && col < dv) *(uint4 *)(orow + col) = c;
            }
            continue;
        }
        if (r >= rows_here) continue;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int col = 8 * j + 2 * t4;
            if (col < dv) *(uint32_t *)(orow + col) = pack2<T>(o[4 * j + 2 * half], o[4 * j + 2 * half + 1]);
        }
    }
}

/* A block's work: which (sequence, head, query tile) and its key-tile range.
 * Block order: (sequence, head) pairs in sections of `section` pairs whose K and V fit in L2 together;
 * within a section the query tiles with the most keys first (load balance), all pairs of the section
 * side by side, so the blocks reading one pair's K/V run at about the same time. */
struct BlockWork {
    HstuSeq s;
    int64_t b;
    int h, i0, pos0, rows_here, kt_lo, kt_hi;
    bool active;  // false: this block's query tile lies past its sequence's end
};
template <int BN>
__device__ __forceinline__ BlockWork block_work(const tf_hstu_params &p, int q_tiles, int section, int64_t item) {
    BlockWork w;
    const int64_t BH = p.B * p.H, per = (int64_t)q_tiles * section;
    const int64_t sec = item / per, r = item % per;
    const int64_t in_sec = min((int64_t)section, BH - sec * section);
    const int tile = q_tiles - 1 - (int)(r / in_sec);
    const int64_t bh = sec * section + r % in_sec;
    w.b = bh / p.H;
    w.h = (int)(bh % p.H);
    w.s = hstu_seq(p, w.b);
    w.i0 = tile * kBM;
    w.active = w.i0 < w.s.nq;
    w.pos0 = w.s.n - w.s.nq + w.i0;
    w.rows_here = min(kBM, w.s.nq - w.i0);
    const int p0 = w.pos0 > 0 ? w.pos0 : 0, p1 = min(w.pos0 + kBM, w.s.n);
    w.kt_lo = 0;
    w.kt_hi = -1;
    if (p0 < p1) {
        int lo, hi;
        tf_hstu_col_range(&w.s.mask, p0, p1, &lo, &hi);
        w.kt_lo = lo / BN;
        w.kt_hi = hi / BN;
    }
    return w;
}
/* What the consumers need of an item's BlockWork, handed over by the producer in shared memory: the
 * fields that take global loads (offsets, num_targets) or 64-bit divisions to find. The rest of the
 * mask is kernel parameters, rebuilt by the consumers. Not the whole BlockWork: the producer writes
 * the slot from its 24 registers, and the whole struct measured 180-188 bytes of spill stores in
 * ptxas -v against these fields' 148-152. */
struct WorkSlot {
    int64_t b, q_start;
    int h, i0, pos0, rows_here, kt_lo, kt_hi, n, t;  // n: the sequence's length, t: its targets
    bool active;                                     // false: no more items, the block ends
};
__device__ __forceinline__ WorkSlot work_slot_of(const BlockWork &w) {
    WorkSlot ws;
    ws.b = w.b;
    ws.q_start = w.s.q_start;
    ws.h = w.h;
    ws.i0 = w.i0;
    ws.pos0 = w.pos0;
    ws.rows_here = w.rows_here;
    ws.kt_lo = w.kt_lo;
    ws.kt_hi = w.kt_hi;
    ws.n = w.s.n;
    ws.t = w.s.mask.t;
    ws.active = w.active;
    return ws;
}
/* The kernel (see the top of the file). TMA reads whole tiles: rows past a sequence's end come from the
 * next one (masked to P = 0, and V's zeroed in shared memory since 0 x inf is NaN; past the tensor's
 * end they are zeros), columns past Dqk / Dv are zeros. */
constexpr int kWsThreads = 384;

template <typename T, int D>
__global__ void __launch_bounds__(kWsThreads, 1)
    hstu_fwd_ws(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                const tf_hstu_params p, int q_tiles, int section, int64_t items, bool vec_store, bool o_tma) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Cfg = Sm90Cfg<D>;
    constexpr int BN = Cfg::BN, KV_BYTES = Cfg::KV_BYTES, STK = Cfg::STK, STV = Cfg::STV, QB = Cfg::QB;
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *Qs = smem, *Ks = smem + QB * Cfg::Q_BYTES, *Vs = Ks + STK * KV_BYTES;
    // k_full / k_empty, v_full / v_empty: the K and V rings; q_full / q_empty: the QB Q buffers, one per
    // work item in turn, each refilled once both consumers' S = Q K^T of its item are done with it
    __shared__ __align__(8) uint64_t k_full[STK], k_empty[STK], v_full[STV], v_empty[STV], q_full[QB], q_empty[QB];

    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int i = 0; i < STK; ++i) {
            mbar_init(&k_full[i], 1);
            mbar_init(&k_empty[i], 8);  // the 8 consumer warps
        }
        for (int i = 0; i < STV; ++i) {
            mbar_init(&v_full[i], 1);
            mbar_init(&v_empty[i], 8);
        }
        for (int i = 0; i < QB; ++i) {
            mbar_init(&q_full[i], 1);
            mbar_init(&q_empty[i], 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Persistent: one block per SM; its producer warp takes work items from a global counter (greedy,
    // in the order longest first within an L2 section: a static stride per block measured 0.8x the
    // one-block-per-item launch on jagged batches of few sequences) and hands each to the consumers,
    // block_work already done (WorkSlot): computing it again after the hand-over put its global loads
    // and divisions on the consumers' path, ~1 us per item, exposed where items are short. Hand-over k:
    //   producer: work_slot[k % 2] = the item, bar.sync 6 (k > 0), bar.arrive 5;
    //   consumers: bar.sync 5, copy work_slot[k % 2] to registers, bar.arrive 6 (not after the last).
    // Named barriers 5 (written) and 6 (read) span the producer warp and the consumers (288 threads; an
    // mbarrier would order it too, but compute-sanitizer's racecheck does not see that). Two slots so
    // that the producer can write before its bar.sync 6, not holding the slot's fields in registers
    // across the wait. Slot k % 2 is free by then: hand-over k - 2's readers copied it before their
    // arrival at 6, which hand-over k - 1's bar.sync 6 waited for. The producer gets no further ahead
    // than before: hand-over k + 1 waits for the consumers to take hand-over k. The ring position g
    // (K/V tiles so far) and the Q count qn run on across items, so the producer loads the next item's
    // Q and first K/V tiles while the consumers finish this one. A slot with active false ends the block.
    __shared__ WorkSlot work_slot[2];
    if (wg == 0) {  // producer
        // 24 here and 240 for the consumers: what this frees (144 x 128) is exactly what they take
        // (72 x 256) of the 168 x 384 the block launched with; an increase with no freed registers
        // to take waits forever (32 / 240 hung)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x < 32) {  // one warp: lane 0 issues, all 32 take part in the named barriers
            const bool leader = threadIdx.x == 0;
            auto next_item = [&]() { return __shfl_sync(0xffffffffu, leader ? atomicAdd(p.sched, 1) : 0, 0); };
            int g = 0, qn = 0, handed = 0, item = next_item();
            for (;;) {
                // The next active item, written to its slot as soon as it is known: w's fields that the
                // loads below do not use would otherwise stay live across the search loop (spills).
                BlockWork w;
                for (;; item = next_item()) {
                    if (item >= items) {
                        if (leader) work_slot[handed & 1].active = false;
                        break;
                    }
                    w = block_work<BN>(p, q_tiles, section, item);
                    if (leader) work_slot[handed & 1] = work_slot_of(w);
                    if (w.active) break;
                }
                __syncwarp();
                if (handed++ > 0) named_bar_sync_n(6, 288);  // the consumers have taken the last hand-over
                named_bar_arrive_n(5, 288);
                if (item >= items) break;
                item = next_item();  // the next one, fetched ahead
                if (w.kt_lo > w.kt_hi) continue;  // nothing to load: the consumers write zeros
                const int qb = qn % QB;
                if (qn >= QB) mbar_wait(&q_empty[qb], (qn / QB - 1) & 1);  // both consumers are done with it
                ++qn;
                if (leader) {
                    mbar_expect_tx(&q_full[qb], Cfg::Q_BYTES);
#pragma unroll
                    for (int c = 0; c < D / 64; ++c)
                        tma_load(Qs + qb * Cfg::Q_BYTES + c * kBM * 128, &tm_q, 64 * c, w.h, (int)(w.s.q_start + w.i0),
                                 &q_full[qb]);
                }
                for (int kt = w.kt_lo; kt <= w.kt_hi; ++kt, ++g) {
                    const int sk = g % STK, sv = g % STV, row = (int)(w.s.start + kt * BN);
                    if (g >= STK) mbar_wait(&k_empty[sk], (g / STK - 1) & 1);
                    if (leader) {
                        mbar_expect_tx(&k_full[sk], KV_BYTES);
#pragma unroll
                        for (int c = 0; c < D / 64; ++c)
                            tma_load(Ks + sk * KV_BYTES + c * BN * 128, &tm_k, 64 * c, w.h, row, &k_full[sk]);
                    }
                    if (g >= STV) mbar_wait(&v_empty[sv], (g / STV - 1) & 1);
                    if (leader) {
                        mbar_expect_tx(&v_full[sv], KV_BYTES);
#pragma unroll
                        for (int c = 0; c < D / 64; ++c)
                            tma_load(Vs + sv * KV_BYTES + c * BN * 128, &tm_v, 64 * c, w.h, row, &v_full[sv]);
                    }
                }
            }
        }
    } else {  // consumers: warpgroups 1, 2 take tile rows 0-63, 64-127
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
        const int cw = wg - 1;
        const float c_t = 0.5f * (float)p.alpha;
        int g = 0, qn = 0;
        // this warp is done with a ring stage or a Q buffer (the empty barriers count 8: one per consumer warp)
        auto release = [](uint64_t *bar) {
            __syncwarp();
            if (threadIdx.x % 32 == 0) mbar_arrive(bar);
        };
        // O through the copy engine (o_tma): this warpgroup's O staged in its own rows of the item's Q buffer
        // (free once its last S is done), stored by TMA, so the consumer goes on to the next item while the
        // rows are written. The warpgroup's warp 0 then frees that Q buffer (its q_empty arrival) only once
        // the store has read the staging (pending_q): at the next item, after its first turn; before an item
        // with no key tiles, and with one Q buffer (D = 256), at the next item's start, before its Q wait,
        // which with one Q buffer waits for this very arrival.
        int pending_q = -1;
        auto flush_o = [&]() {
            if (pending_q >= 0) {
                if (threadIdx.x % 128 == 0) {
                    bulk_wait_group_read0();
                    mbar_arrive(&q_empty[pending_q]);
                }
                pending_q = -1;
            }
        };
        for (int k = 0;; ++k) {
            named_bar_sync_n(5, 288);
            // copied before arriving at 6: from then on the producer may rewrite this slot (hand-over k + 2)
            const WorkSlot w = work_slot[k & 1];
            if (!w.active) break;
            named_bar_arrive_n(6, 288);
            const tf_hstu_mask mask = tf_hstu_mask_make(w.n, w.t, p.contextual, p.max_attn_len, p.min_full, p.group);
            // the mask bits' form (mask_bits), uniform per item: 1 plain causal, 2 a plain window, 0 the spans
            const int fast = tf_hstu_causal(mask) ? 1 : tf_hstu_band(mask) ? 2 : 0;
            const int kt_lo = w.kt_lo, kt_hi = w.kt_hi;
            const int wpos0 = w.pos0 + 64 * cw;
            // staged: this warpgroup's 64 rows all in the sequence (a partial tile's rows past its end belong to
            // the next sequence, which a whole-box store would overwrite) and a Q buffer to stage in
            const bool staged = o_tma && kt_lo <= kt_hi && w.rows_here >= 64 * (cw + 1);
            const bool q_release = !staged || (threadIdx.x / 32) % 4 != 0;  // warp 0 of a staged one frees later
            if (QB == 1 || kt_lo > kt_hi) flush_o();  // one Q buffer: its next load waits for this
            float o[D / 2];
#pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
            int qb = 0;
            if (kt_lo <= kt_hi) {
                qb = qn % QB;
                mbar_wait(&q_full[qb], (qn / QB) & 1);
                ++qn;
                const uint32_t q_addr = smem_u32(Qs + qb * Cfg::Q_BYTES) + cw * 64 * 128;
                float sacc[BN / 2];
                uint32_t pa[BN / 16][4];
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) sacc[i] = 0.f;
                // Ping-pong: after the SiLU of tile j, one batch issues P V of tile j and S of tile
                // j + 1, in turns with the other consumer (named barriers 1 + cw: sync on mine before
                // issuing, arrive on the other's after), so one's SiLU runs while the other's MMAs
                // do. No warpgroup skips a tile here (the mask zeroes P where its rows cannot
                // reach): a branch around the MMAs or the code defining P makes ptxas serialize the
                // wgmmas (C7520). Each item's turns balance (every sync gets exactly one arrival),
                // and neither consumer can start the next item's turns before the other has taken
                // its last one of this item. A turn's end frees tile j's V and tile j + 1's K.
                const int mine = 1 + cw, other = 2 - cw;
                if (cw == 1) named_bar_arrive(1);  // consumer 0 goes first
                mbar_wait(&k_full[g % STK], (g / STK) & 1);
                named_bar_sync(mine);
                tf_wgmma_fence();
                tf_gemm_ss<T, D, kBM, BN>(sacc, q_addr, smem_u32(Ks + (g % STK) * KV_BYTES));
                tf_wgmma_commit();
                named_bar_arrive(other);
                tf_wgmma_wait<0>();
                tf_wgmma_reg_fence(sacc);
                release(&k_empty[g % STK]);
                flush_o();  // the previous item's O store has long read its staging
                for (int j = kt_lo; j < kt_hi; ++j) {
                    const int gi = g + j - kt_lo, sv = gi % STV, nsk = (gi + 1) % STK;
                    elementwise<T, BN>(sacc, pa, p, mask, fast, w.b, w.h, wpos0, j * BN, c_t);
                    mbar_wait(&v_full[sv], (gi / STV) & 1);
                    mbar_wait(&k_full[nsk], ((gi + 1) / STK) & 1);
                    named_bar_sync(mine);
                    tf_wgmma_fence();
                    tf_gemm_rs<T, D, BN>(o, pa, smem_u32(Vs + sv * KV_BYTES));
                    tf_gemm_ss<T, D, kBM, BN>(sacc, q_addr, smem_u32(Ks + nsk * KV_BYTES));
                    tf_wgmma_commit();
                    named_bar_arrive(other);
                    tf_wgmma_wait<0>();
                    tf_wgmma_reg_fence(sacc);
                    tf_wgmma_reg_fence(o);
                    __syncwarp();
                    if (threadIdx.x % 32 == 0) {
                        mbar_arrive(&v_empty[sv]);
                        mbar_arrive(&k_empty[nsk]);
                    }
                }
                if (q_release) release(&q_empty[qb]);  // every S of this item is done
                {  // the last tile: its P V alone
                    const int gi = g + kt_hi - kt_lo, sv = gi % STV;
                    elementwise<T, BN>(sacc, pa, p, mask, fast, w.b, w.h, wpos0, kt_hi * BN, c_t);
                    mbar_wait(&v_full[sv], (gi / STV) & 1);
                    // only the last tile can run past the sequence's end
                    if (kt_hi * BN + BN > w.n) zero_tail_rows<D, BN>(Vs + sv * KV_BYTES, w.n - kt_hi * BN, cw);
                    named_bar_sync(mine);
                    tf_wgmma_fence();
                    tf_gemm_rs<T, D, BN>(o, pa, smem_u32(Vs + sv * KV_BYTES));
                    tf_wgmma_commit();
                    if (cw == 0) named_bar_arrive(other);  // every sync gets exactly one arrival
                    tf_wgmma_wait<0>();
                    tf_wgmma_reg_fence(o);
                    release(&v_empty[sv]);
                }
                g += kt_hi - kt_lo + 1;
            }
#pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] *= (float)p.inv_scale;  // P's 1 / S_norm
            if (staged) {
                const uint32_t dst = smem_u32(Qs + qb * Cfg::Q_BYTES) + cw * 64 * 128;
                stage_acc<T, D>(o, dst, kBM * 128);  // this warpgroup's rows of each Q panel
                fence_proxy_async();
                named_bar_sync_n(3 + cw, 128);  // the warpgroup's rows all staged
                if (threadIdx.x % 128 == 0) {
#pragma unroll
                    for (int c = 0; c < D / 64; ++c)
                        if (64 * c < p.dv) tma_store(&tm_o, dst + c * kBM * 128, 64 * c, w.h, (int)(w.q_start + w.i0 + 64 * cw));
                    bulk_commit_group();
                }
                pending_q = qb;
            } else {
                store_o<T, D>(o, p, w.q_start + w.i0, w.h, 64 * cw, w.rows_here, vec_store);
            }
        }
        if (threadIdx.x % 128 == 0) bulk_wait_group0();  // the stores done before the block's shared memory goes
    }
#endif
}

#if defined(TF_BUILT_SM90A)  // the host side of the sm_90a kernel

/* -1: the copy engine cannot address these tensors (the caller falls back to mma.sync) */
template <typename T, int D>
int launch(const tf_hstu_params &p, cudaStream_t stream) {
    const HstuFwdGrid g = hstu_fwd_grid(p, kBM);
    if (g.err != cudaSuccess || g.blocks == 0) return g.err;
    CUtensorMap tq, tk, tv, to;
    const int64_t q_rows = p.delta > 0 ? p.B * p.delta : p.L;
    if (!tensor_map(&tq, p.dtype, p.q, q_rows, p.H, p.dqk, p.q_sr, p.q_sh, kBM) ||
        !tensor_map(&tk, p.dtype, p.k, p.L, p.H, p.dqk, p.k_sr, p.k_sh, Sm90Cfg<D>::BN) ||
        !tensor_map(&tv, p.dtype, p.v, p.L, p.H, p.dv, p.v_sr, p.v_sh, Sm90Cfg<D>::BN))
        return -1;
    constexpr int smem = Sm90Cfg<D>::SMEM;
    cudaError_t err = cudaFuncSetAttribute(hstu_fwd_ws<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    // persistent: one block per SM (one fits: shared memory), each taking items from the counter
    if (!p.sched) return -1;
    const int64_t grid = g.blocks < device_sizes().sms ? g.blocks : device_sizes().sms;
    err = cudaMemsetAsync(p.sched, 0, sizeof(int), stream);
    if (err != cudaSuccess) return err;
    // O rows the copy engine does not store: 16-byte stores where the rows allow (dv a multiple of 8, an
    // aligned output: always, as the op allocates it), against 4-byte stores +7.5% at 128x1024x128, +3.7%
    // at 16x4096x128, +12.7% at head dim 256 on an H100
    const bool vec = p.dv % 8 == 0 && reinterpret_cast<uintptr_t>(p.o) % 16 == 0;
    // O staged in the item's Q buffer and stored by the copy engine where it can address the output; the 16-
    // or 4-byte stores above take the rest. On an H100: +20% at 128x1024x128 (with the second Q buffer, which
    // alone gave +3%), +5% at 16x4096x128, +12% with a window; +1-4% at head dim 256, where the next item's
    // Q load waits for the store to read its staging
    const bool o_tma = tensor_map(&to, p.dtype, p.o, q_rows, p.H, p.dv, p.H * p.dv, p.dv, 64);
    if (!o_tma) to = tq;  // unused
    hstu_fwd_ws<T, D><<<(unsigned)grid, kWsThreads, smem, stream>>>(
        tq, tk, tv, to, p, g.q_tiles, l2_section(p.max_seq_len * (p.dqk + p.dv) * 2, p.B * p.H, g.q_tiles),
        (int)g.blocks, vec, o_tma);
    return cudaGetLastError();
}

template <typename T>
int dispatch(const tf_hstu_params &p, cudaStream_t stream) {
    // Ping-pong at every head dim: against the loop without turns, 1.00-1.02x at 16 x 1024, 1.05-1.07x at
    // 128 x 1024, 1.06x with a window, 1.08-1.11x at 4096, 1.19-1.23x at 16x4096x256 (H100)
    return hstu_with_head_dim(p, [&](auto D) { return launch<T, decltype(D)::value>(p, stream); });
}

#endif

}  // namespace

extern "C" int tf_hstu_fwd_sm90(const tf_hstu_params *p, void *stream) {
#if defined(TF_BUILT_SM90A)
    if (p->dtype != TF_BF16 && p->dtype != TF_F16) return -1;
    if (p->backend == TF_HSTU_MMA || !device_is_sm90()) return -1;
    const int64_t d = p->dqk > p->dv ? p->dqk : p->dv;
    // 1.14-2.8x mma.sync at every benchmark shape (jagged, targets and window included) on an H100; cached
    // inference (delta query rows per sequence) measured faster on mma.sync up to head dim 128
    if (p->backend == TF_HSTU_AUTO && p->delta > 0 && d <= 128) return -1;
    if (p->dtype == TF_BF16) return dispatch<__nv_bfloat16>(*p, (cudaStream_t)stream);
    return dispatch<__half>(*p, (cudaStream_t)stream);
#else
    (void)p;
    (void)stream;
    return -1;
#endif
}
