/* HSTU attention backward on Hopper (sm_90a): warp-specialized, TMA loads, warpgroup MMA (wgmma).
 *
 * Same semantics as hstu_bwd_mma (hstu_bwd.cu), FlashAttention-2's backward order: work item = (key
 * tile of kBN keys, sequence, head); (sequence, head) pairs in sections whose Q and dO fit in L2,
 * within a section the lowest key tiles (they see the most query tiles) first. Persistent: one block
 * per SM takes items in that order from a global counter (p.sched, zeroed on the stream by the launch),
 * greedily, so that each block's fixed costs (launch, barrier setup, the K/V load before the first
 * wgmma, the dK/dV stores at the end) are paid once or hidden behind the neighbouring items: at 128 x
 * 1024 x 128, H = 4, a one-block-per-item launch ran 4096 blocks of ~9 query tiles each. Per block:
 *   - warpgroup 0 produces, one warp of it: per item, it finds the item (skipping those whose key tile
 *     starts past its sequence's end), hands it to the consumers through shared memory (two slots,
 *     named barriers 5 and 6, as the forward), loads the K and V tiles (TMA, on kv_full) once the
 *     consumers have released the previous item's (kv_empty: after their last wgmma reading them, so
 *     the load overlaps their dK / dV stores), and the query tiles tf_hstu_row_range() allows (kBQ = 64
 *     rows of Q and dO each) through a ring of ST stages (full / empty mbarriers) whose position runs on
 *     across items: an item's first ST tiles load before its K and V, while the consumers finish the
 *     previous item. The warpgroup hands most of its registers to the consumers;
 *   - warpgroups 1 and 2 consume: per query tile, with keys as accumulator rows (64 keys a warpgroup),
 *       S^T = K Q^T, dP^T = V dO^T              wgmma, both operands in shared memory
 *       P^T = SiLU(alpha S^T) / S_norm, dZ^T = dP^T alpha / S_norm . s (1 + z (1 - s)), masked (P^T
 *       without its 1 / S_norm, which dV takes at the item's end; both from one tanh, see cw's constants)
 *       dV += P^T dO, dK += dZ^T Q              wgmma, P^T / dZ^T from registers (head dims 192 / 256: from
 *                                               shared memory, see below), dO / Q transposed
 *       dQ  = dZ K                              wgmma from shared memory: dZ^T is stored transposed
 *                                               (stmatrix) into a 128-byte-swizzled tile, double-buffered
 *     and add dQ into the fp32 buffer p.dq_acc (the caller casts it); at head dims 65-256 with p.dz set
 *     (tf_hstu_bwd_sm90_dz_bytes) the DZ form stores dZ's tiles instead and hstu_bwd_dq_sm90.cu computes
 *     dQ = dZ K from them (see hstu_bwd_ws). Head dims up to 128: each warpgroup
 *     writes its 64 x 64 fp32 dQ into its own 128-byte-swizzled staging tile in shared memory, and one of
 *     its threads adds that to p.dq_acc with TMA bulk reduce-adds (two boxes of 32 columns), as
 *     FlashAttention-3 does; per-thread red.global.add straight from the accumulator (16 vector reductions
 *     per thread per tile) had the consumers stalled on long_scoreboard and lg_throttle in an ncu profile.
 *     Head dims 192 and 256 (shared memory is full there): the same reduce-adds, from the consumer's own
 *     column half of the stage's Q and dO panels (below). Where p.dq_acc's map cannot be made:
 *     red.global.add from the registers. dK and dV
 *     stay in registers, 64 + 64 per thread, and are written once at the item's end (16-byte stores after
 *     a transpose within each quad of threads: 4-byte stores of the accumulator layout half-fill sectors). How the two warpgroups
 *     share the work (BwdSm90Cfg):
 *       head dims 64, 128: kBN = 128 keys, warpgroup w owns keys 64 w.. (all D columns of dK, dV). At
 *         128 they split dQ's columns (each reads both halves of dZ: one named barrier per tile); at 64
 *         its keys (each adds its own partial: no barrier between them).
 *       head dim 256 (and 192): kBN = 64 keys, BOTH warpgroups work on those 64 keys and warpgroup w owns
 *         columns 128 w.. of dK and dV (64 keys x 128 columns: 64 + 64 registers as at 128; all 256 columns
 *         of one warpgroup's 64 keys would be 256). Warpgroup w computes S^T and dP^T for query rows 32 w..
 *         of the tile (64 keys x 32 queries, K dimension 256) and stores its P^T and dZ^T columns
 *         transposed into shared memory (P and dZ tiles, double-buffered); after one barrier both read
 *         the whole tiles as MN-major A operands: dV += P^T dO[:, half], dK += dZ^T Q[:, half] (both
 *         operands in shared memory), and dQ's columns are split (128 a warpgroup, in two chunks of 64 so
 *         its accumulator stays at 32 registers beside dK and dV). Each warpgroup computing S^T and dP^T
 *         in full instead (P^T and dZ^T from registers, nothing exchanged before dK and dV) did 5 GEMMs'
 *         work as 7.
 *   - the mask comes as bits from the keys' spans (tf_hstu_col_spans via hstu_col_bits), tiles inside
 *     it skip it;
 *   - TMA reads whole tiles: rows past the sequence's end come from the next sequence (past the
 *     tensor's end they are zeros), so the tail rows of K (first tile) and of Q and dO (the last query
 *     tile) are zeroed in shared memory before use: masked elements are 0, but 0 x inf is not.
 *     The TMA reduce-add of dQ writes whole tiles too (clipped only at L and dqk): rows past the
 *     sequence's end are stored as 0 in the staging tile (see there why they must be).
 * Head dims up to 256, bf16 / fp16, no attn_bias: otherwise (and off compute capability 9.0, or where
 * the copy engine cannot address the tensors) the entry point declines and hstu_bwd.cu's mma.sync
 * kernel runs, as it does for the TF_HSTU_MMA backend. */
#include <cuda_runtime.h>
#include <string.h>

#include "hstu_mma.cuh"
#include "tf_sm90.cuh"
#include "tf_wgmma.cuh"

namespace {

constexpr int kBQ = 64;  // query rows per step
constexpr int kThreads = 384;

template <int D>
struct BwdSm90Cfg {
    // Up to head dim 128 the two consumer warpgroups split the block's keys (64 each, all D columns of dK
    // and dV); at 256 they share 64 keys and split dK and dV's columns (D / 2 each): 64 + 64 accumulator
    // registers per thread either way
    static constexpr bool COL_SPLIT = D > 128;
    static constexpr int BN = hstu_sm90_key_tile(D);  // keys per block: 64 at the column split
    static constexpr int NC = COL_SPLIT ? D / 2 : D;  // dK / dV columns per consumer warpgroup
    static constexpr int ST = D <= 64 ? 4 : D <= 128 ? 3 : 2;  // Q / dO ring stages
    static constexpr int KV_BYTES = BN * D * 2, QO_BYTES = kBQ * D * 2, Z_BYTES = kBQ * BN * 2;
    // the column split's P tiles (as the dZ tiles: query rows, keys along the row), double-buffered
    static constexpr int P_BYTES = COL_SPLIT ? 2 * Z_BYTES : 0;
    // dQ's columns split between the consumers (else its keys: two partial sums added), in DQ_CHUNKS
    // chunks of 64 columns per warpgroup
    static constexpr bool DQ_SPLIT_N = D >= 128;
    static constexpr int DQ_CHUNKS = DQ_SPLIT_N ? D / 128 : 1;
    // K, V, the Q and dO rings, dZ twice, P twice at the column split; +1024: tiles start on the
    // swizzle pattern's 1024-byte period
    static constexpr int SMEM = 2 * KV_BYTES + 2 * ST * QO_BYTES + 2 * Z_BYTES + P_BYTES + 1024;
    // dQ through shared memory and a TMA reduce-add (head dims up to 128; at 256 shared memory is full: dQ
    // is staged in the ring's panels there, no tiles of its own): one fp32 staging tile of kBQ rows x 64
    // columns per consumer warpgroup, as two 128-byte-swizzled boxes of 32 columns (the swizzle's 128-byte row)
    static constexpr bool DQ_TMA = !COL_SPLIT;
    static constexpr int DQ_BOX_BYTES = kBQ * 32 * 4, DQ_WG_BYTES = 2 * DQ_BOX_BYTES;
    static constexpr int SMEM_TMA = SMEM + (DQ_TMA ? 2 * DQ_WG_BYTES : 0);
    static_assert(SMEM + 256 <= 232448, "227 KB of shared memory per block (+ the static mbarriers and work slots)");
    static_assert(SMEM_TMA + 256 <= 232448, "the same with the dQ staging tiles");
    static_assert(!DQ_TMA || DQ_CHUNKS == 1, "the TMA dQ path: one 64-column chunk a warpgroup per tile");
    static_assert(!COL_SPLIT || (BN == 64 && NC == 128), "the column split: 64 keys, 128 columns a warpgroup");
    static_assert(!DQ_SPLIT_N || 2 * 64 * DQ_CHUNKS == D, "the two consumers' dQ chunks cover the head dim");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* four 8 x 8 16-bit matrices (mma.sync fragment layout) stored transposed: lane 8 m + i gives the
 * address of row i of matrix m as stored */
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
__device__ __forceinline__ void st_shared_v2(uint32_t addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void red_add_v2(float *dst, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}
/* A consumer warpgroup's 64 x 64 fp32 dQ fragment (rows: query r0 + 16 warp + g + 8 hh of the tile, i.e.
 * dq[4 j + 2 hh + e] at column 8 j + 2 t4 + e) into a staging tile of two 128-byte-swizzled boxes of 32
 * columns, box_bytes apart, for TMA reduce-adds; rows whose query is at or past len are stored as 0 (the
 * reduce adds all 64 rows: see the TMA path for why they must be 0). */
__device__ __forceinline__ void dq_stage(uint32_t dqs, const float (&dq)[32], int box_bytes, int warp, int g, int t4,
                                         int q0, int len) {
    const uint32_t a0 = dqs + (16 * warp + g) * 128 + 8 * (t4 & 1), x = 16 * ((t4 / 2) ^ g);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const bool in = q0 + 16 * warp + g + 8 * hh < len;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            st_shared_v2(a0 + ((32 * (j % 4)) ^ x) + hh * 8 * 128 + (j / 4) * box_bytes, in ? dq[4 * j + 2 * hh] : 0.f,
                         in ? dq[4 * j + 2 * hh + 1] : 0.f);
    }
}
/* The same fragment added into dQ's rows (row_of(pos): the fp32 row of query pos) by red.global.add,
 * columns col0.. clipped at dqk, rows at or past len skipped. */
__device__ __forceinline__ void dq_red(float *dq_acc, int64_t row0, int64_t H, int h, int dqk, int col0, const float (&dq)[32],
                                       int warp, int g, int t4, int q0, int len) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int pos = q0 + 16 * warp + g + 8 * hh;
        if (pos >= len) continue;
        float *dst = dq_acc + ((row0 + pos) * H + h) * (int64_t)dqk;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = col0 + 8 * j + 2 * t4;
            if (col < dqk) red_add_v2(dst + col, dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]);
        }
    }
}
#endif

/* A work item: key tile kt of a (sequence, head) pair. Item order: (sequence, head) pairs in sections
 * whose Q and dO fit in L2 together, within a section the lowest key tiles (the most query tiles) first,
 * the section's pairs side by side. BwdItem is what the consumers need of it, found by the producer and
 * handed over in shared memory (offsets and num_targets are global loads, the order divisions). */
struct BwdItem {
    int64_t start;                  // the sequence's first row
    int b, h, k0, n, t, nctx, lo_t, total;  // sequence, head, first key, length, targets; the query tiles (below)
    int active;                     // 0: k0 >= n (skipped) / in the hand-over: no more items, the block ends
};
template <int kBN>
__device__ __forceinline__ BwdItem bwd_item(const tf_hstu_params &p, int k_tiles, int section, int item) {
    // 32-bit: k_tiles x B x H items fit an int (the launch checks), so do B x H and k_tiles x section
    const int H = (int)p.H, BH = (int)(p.B * p.H), per = k_tiles * section, sec = item / per, r = item % per;
    const int in_sec = min(section, BH - sec * section);
    const int bh = sec * section + r % in_sec;
    const HstuSeq s = hstu_seq(p, bh / H);
    BwdItem w;
    w.start = s.start;
    w.b = bh / H;
    w.h = bh % H;
    w.k0 = (r / in_sec) * kBN;
    w.n = s.n;
    w.t = s.mask.t;
    w.active = w.k0 < s.n;
    w.nctx = w.lo_t = w.total = 0;
    if (w.active) {
        // the query tiles that can see these keys: context rows first (nctx tiles from 0), then the
        // causal (or windowed) range from tile lo_t; query tile of step i: q_tile(w, i)
        const HstuQueryTiles qt = hstu_query_tiles<kBQ>(s.mask, w.k0, min(w.k0 + kBN, s.n));
        w.lo_t = qt.lo_t;
        w.nctx = qt.nctx;
        w.total = qt.nctx + max(0, qt.hi_t - qt.lo_t + 1);
    }
    return w;
}
__device__ __forceinline__ __attribute__((unused)) int q_tile(const BwdItem &w, int i) { return i < w.nctx ? i : w.lo_t + i - w.nctx; }

/* DZ (head dims 65-256): the first part of the two-part backward. Each query tile's 64 x kBN dZ tile (64
 * keys, 8 KB, at head dims 129-256; 128 keys in two 64-key panels, 16 KB, at 65-128), once both consumers
 * have stored their parts (barrier 2), leaves as it lies in shared memory (128-byte swizzled) by one bulk
 * copy into p.dz at slot ((b H + h) k_tiles + key tile) q_tiles + query tile (q_tiles: max_seq_len's
 * 64-row tiles), and the tile does no dQ work; hstu_bwd_dq_sm90.cu then computes dQ = dZ K from those
 * slots. The issuing thread (the first consumer thread) waits until its previous copy has read the tile
 * before barrier 2, which every consumer passes before it stores the Z buffer again (two tiles later). */
template <typename T, int D, bool DZ>
__global__ void __launch_bounds__(kThreads, 1)
    hstu_bwd_ws(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                const __grid_constant__ CUtensorMap tm_dq, const tf_hstu_params p, int k_tiles, int section,
                int items, int flags) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = BwdSm90Cfg<D>;
    static_assert(!DZ || D >= 128, "the stored dZ tiles: head dims 65-256 (hstu_bwd_dq_sm90.cu's tiles)");
    constexpr int kBN = C::BN, NC = C::NC, ST = C::ST, KV_BYTES = C::KV_BYTES, QO_BYTES = C::QO_BYTES;
    constexpr int QN = C::COL_SPLIT ? kBQ / 2 : kBQ;  // query rows of a tile per consumer in S^T and dP^T
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *Ks = smem, *Vs = Ks + KV_BYTES, *Qs = Vs + KV_BYTES, *Os = Qs + ST * QO_BYTES, *Zs = Os + ST * QO_BYTES;
    // flags: bit 0 dQ by TMA reduce-adds, bit 1 dK / dV by 16-byte stores (the launch's choices)
    // dQ's staging tiles up to head dim 128 (launched with SMEM_TMA bytes only when flags bit 0 is set):
    // consumer cw's at DQs + cw * DQ_WG_BYTES
    uint8_t *Ps = Zs + 2 * C::Z_BYTES, *DQs = Ps + C::P_BYTES;
    const bool dq_tma = (C::DQ_TMA || C::COL_SPLIT) && (flags & 1);  // uniform over the block
    const bool vec_store = (flags & 2) != 0;        // dK / dV by 16-byte stores (see the item's end)
    // kv_full / kv_empty: the one K/V buffer, phase k for the block's k-th item; full / empty: the Q/dO
    // ring, slot gt % ST and phase gt / ST for the block's gt-th query tile (counted across items, the
    // same count on both sides: the consumers take exactly the items, and their tiles, the producer
    // loads). Hand-over k (as the forward's):
    //   producer: work_slot[k % 2] = the item (or active = 0: the end), bar.sync 6 (k > 0), bar.arrive 5;
    //   consumers: bar.sync 5, copy work_slot[k % 2], bar.arrive 6 unless it was the end.
    // Named barriers 5 and 6 span the producer warp and the consumers (288 threads); 1 (tail zeroing,
    // 256), 2 (dZ, and P at the column split, stored, 256), 3 + cw (dZ stored, 128, head dim 64) and 7 + cw (dQ staged, 128, the TMA
    // dQ path) are the consumers' per tile.
    // Each consumer waits at 5 for every item, so the two warpgroups enter an item together.
    // Why nothing waits forever: the producer waits on kv_empty phase k - 1 only for an item k it
    // handed over, and the consumers arrive on every phase of an item they took (after its tile loop,
    // also when it has no tiles); the producer waits on empty for tile gt - ST, which the consumers
    // finish without anything the producer has still to do (its tiles and, for ring slots of this
    // item's own tiles, this item's K and V, are loaded first). A block that takes no item hands over
    // the end at once: no thread waits on a barrier but 5.
    // The Z (and P) double buffer (gt & 1): a warpgroup stores Z of tile gt + 2 after the barrier of tile
    // gt + 1, which the other passed only after its wgmmas of tile gt (dK, dV, dQ) had completed.
    // K's tail rows, zeroed by consumer 0 at an item's first tile, are not overwritten by the next
    // item's load before every consumer warp is done with them: that load waits for kv_empty.
    // dQ's staging tile (TMA path), per consumer warpgroup, per query tile: the warpgroup's thread 0, which
    // issued the bulk reduce of its previous tile, waits until that has read the tile
    // (cp.async.bulk.wait_group.read) before the dZ barrier (2 or 3 + cw), which every thread of the
    // warpgroup passes before it writes the tile (after the dQ wgmma); then fence.proxy.async, barrier
    // 7 + cw, and thread 0 issues the reduce (one box of 32 columns, two where dqk reaches the second)
    // and commits it. Thread 0 waits for all its bulk groups before the block ends (the reduces read
    // shared memory until they complete).
    __shared__ __align__(8) uint64_t kv_full, kv_empty, full_bar[ST], empty_bar[ST];
    __shared__ BwdItem work_slot[2];

    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbar_init(&kv_full, 1);
        mbar_init(&kv_empty, 8);  // the 8 consumer warps, after their item's last wgmma reading K or V
        for (int i = 0; i < ST; ++i) {
            mbar_init(&full_bar[i], 1);
            mbar_init(&empty_bar[i], 8);  // the 8 consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
        // 24 + 2 x 240 = 3 x 168, the registers the block launched with (an increase that no decrease
        // pays for waits forever)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x < 32) {  // one warp: lane 0 issues, all 32 take part in the named barriers
            const bool leader = threadIdx.x == 0;
            auto next_item = [&]() { return __shfl_sync(0xffffffffu, leader ? atomicAdd(p.sched, 1) : 0, 0); };
            int gt = 0;  // query tiles loaded so far (the ring position)
            for (int k = 0;; ++k) {  // hand-over k: the block's k-th item with keys (or the end)
                BwdItem w;
                int item;
                for (;;) {  // items whose key tile starts past the sequence's end are skipped here
                    item = next_item();
                    if (item >= items) break;
                    w = bwd_item<kBN>(p, k_tiles, section, item);
                    if (w.active) break;
                }
                if (leader) {
                    if (item >= items) work_slot[k & 1].active = 0;
                    else work_slot[k & 1] = w;
                }
                __syncwarp();
                if (k > 0) named_bar_sync_n(6, 288);  // the consumers have taken hand-over k - 1
                named_bar_arrive_n(5, 288);
                if (item >= items) break;
                // The item's fields are read back from the slot where used (the waits' memory clobbers
                // make them reloads): the producer's 24 registers do not hold them across its waits.
                // After the first item: its first ST query tiles (i < pre) take ring slots that earlier
                // items' tiles free, so they load while the consumers finish the previous item; then K and
                // V, once the consumers' last wgmma reading the previous item's has completed (kv_empty,
                // before their dK / dV stores); then the rest (slots this item's own tiles free).
                const BwdItem *ws = &work_slot[k & 1];
                const int total = ws->total, pre = k > 0 ? min(ST, total) : 0;
                for (int i = 0;; ++i, ++gt) {
                    if (i == pre) {  // pre <= total: reached
                        if (k > 0) mbar_wait(&kv_empty, (k - 1) & 1);
                        if (leader) {
                            mbar_expect_tx(&kv_full, 2 * KV_BYTES);
                            const int row = (int)(ws->start + ws->k0);
#pragma unroll
                            for (int c = 0; c < D / 64; ++c) {
                                tma_load(Ks + c * kBN * 128, &tm_k, 64 * c, ws->h, row, &kv_full);
                                tma_load(Vs + c * kBN * 128, &tm_v, 64 * c, ws->h, row, &kv_full);
                            }
                        }
                    }
                    if (i >= total) break;
                    // query tile i of this item into ring slot gt % ST
                    const int st = gt % ST;
                    if (gt >= ST) mbar_wait(&empty_bar[st], (gt / ST - 1) & 1);
                    if (leader) {
                        mbar_expect_tx(&full_bar[st], 2 * QO_BYTES);
                        const int row = (int)(ws->start + q_tile(*ws, i) * kBQ);
#pragma unroll
                        for (int c = 0; c < D / 64; ++c) {
                            tma_load(Qs + st * QO_BYTES + c * kBQ * 128, &tm_q, 64 * c, ws->h, row, &full_bar[st]);
                            tma_load(Os + st * QO_BYTES + c * kBQ * 128, &tm_do, 64 * c, ws->h, row, &full_bar[st]);
                        }
                    }
                }
            }
        }
    } else {  // consumers: warpgroups 1, 2 own keys k0 + 0-63, k0 + 64-127 (at D = 256: the same 64 keys,
              // columns 0-127 / 128-255 of dK and dV)
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
        const int cw = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
        const int kr0 = C::COL_SPLIT ? 0 : 64 * cw;  // this warpgroup's first key in the tile
        const int nc0 = C::COL_SPLIT ? NC * cw : 0;  // this warpgroup's first dK / dV column
        const int qw0 = C::COL_SPLIT ? QN * cw : 0;  // this warpgroup's first query row of a tile in S^T, dP^T
        // The element-wise step, with h = alpha s / 2, t = tanh(h) (so z = 2 h, sigmoid(z) = (1 + t) / 2):
        //   z sigmoid(z) = h (1 + t); dZ's factor alpha / S sigmoid(z) (1 + z (1 - sigmoid(z))) = w (1 + h (1 - t))
        //   with w = kz (1 + t), kz = alpha / (2 S): six FP32 instructions and a tanh per element (the
        //   textbook form took ten). P^T is left without its 1 / S: dV is scaled once, at the item's end.
        const float h_s = 0.5f * (float)p.alpha, kz = h_s * (float)p.inv_scale;
        const uint32_t k_addr = smem_u32(Ks), v_addr = smem_u32(Vs);
        int gt = 0;  // query tiles consumed so far (the ring position, and the Z buffer gt & 1)
        // Column split, TMA dQ: warp 0's hand-back of a stage is deferred until its reduce-adds have read
        // the staged dQ; thread 0 of the warpgroup waits for that read one tile later, behind the next
        // tile's S^T / dP^T wgmmas, instead of at once (16x4096x256 on an H100: 315 -> 336 TFLOP/s).
        int stage_read = -1;  // thread 0: the slot whose reduces may still be reading it, or -1
        auto hand_back_read_stage = [&]() {
            if constexpr (C::COL_SPLIT) {
                if (stage_read >= 0) {
                    bulk_wait_group_read0();
                    mbar_arrive(&empty_bar[stage_read]);
                    stage_read = -1;
                }
            }
        };
        for (int k = 0;; ++k) {
            named_bar_sync_n(5, 288);
            // copied before arriving at 6: from then on the producer may rewrite this slot (hand-over k + 2)
            const BwdItem w = work_slot[k & 1];
            if (!w.active) break;
            named_bar_arrive_n(6, 288);
            const tf_hstu_mask mask = tf_hstu_mask_make(w.n, w.t, p.contextual, p.max_attn_len, p.min_full, p.group);
            const int k0 = w.k0, len = w.n, h = w.h;
            const int kw0 = k0 + kr0;               // this warpgroup's first key in the sequence
            const int key_a = kw0 + 16 * warp + g;  // this thread's keys: key_a, key_a + 8
            float dk[NC / 2], dv[NC / 2];
#pragma unroll
            for (int i = 0; i < NC / 2; ++i) dk[i] = dv[i] = 0.f;
            // before waiting for K and V: the producer loads them after this item's first query tiles,
            // which may need the slot still held
            hand_back_read_stage();
            mbar_wait(&kv_full, k & 1);

            for (int it = 0; it < w.total; ++it, ++gt) {
                const int st = gt % ST, q0 = q_tile(w, it) * kBQ;
                uint8_t *Qt = Qs + st * QO_BYTES, *Ot = Os + st * QO_BYTES, *Zt = Zs + (gt & 1) * C::Z_BYTES;
                uint8_t *Pt = Ps + (gt & 1) * C::Z_BYTES;  // the column split's only
                mbar_wait(&full_bar[st], (gt / ST) & 1);
                // tail rows (the same decision in every thread of both consumers)
                const bool k_tail = it == 0 && k0 + kBN > len, q_tail = q0 + kBQ > len;
                if (k_tail || q_tail) {
                    if (k_tail && cw == 0) zero_rows<D, kBN>(Ks, len - k0);
                    if (q_tail) zero_rows<D, kBQ>(cw == 0 ? Qt : Ot, len - q0);
                    fence_proxy_async();
                    named_bar_sync(1);
                }
                float sacc[QN / 2], dpacc[QN / 2];
                tf_wgmma_fence();
                tf_gemm_ss<T, D, kBN, QN, kBQ>(sacc, k_addr + kr0 * 128, smem_u32(Qt) + qw0 * 128);
                tf_gemm_ss<T, D, kBN, QN, kBQ>(dpacc, v_addr + kr0 * 128, smem_u32(Ot) + qw0 * 128);
                tf_wgmma_commit();
                hand_back_read_stage();
                tf_wgmma_wait<0>();
                tf_wgmma_reg_fence(sacc);
                tf_wgmma_reg_fence(dpacc);

                // accumulator element i = 4 j + 2 hh + e: key key_a + 8 hh, query q0 + qw0 + 8 j + 2 t4 + e
                if (tf_hstu_tile_full(&mask, q0 + qw0, q0 + qw0 + QN, kw0, kw0 + 64)) {
#pragma unroll
                    for (int i = 0; i < QN / 2; ++i) {
                        const float hv = h_s * sacc[i], t = tanh_approx(hv), w = fmaf(t, kz, kz);
                        sacc[i] = fmaf(hv, t, hv);
                        dpacc[i] *= fmaf(w, fmaf(-hv, t, hv), w);
                    }
                } else {
                    const uint32_t bits[2] = {hstu_col_bits<QN / 8>(mask, key_a, q0 + qw0 + 2 * t4),
                                              hstu_col_bits<QN / 8>(mask, key_a + 8, q0 + qw0 + 2 * t4)};
#pragma unroll
                    for (int i = 0; i < QN / 2; ++i) {
                        // the full tile's arithmetic, then the mask as an AND with all ones or zero: selects here had
                        // ptxas move and spill registers around the masked path (46 spill instructions in the tile
                        // loop at head dim 128, none with the AND; 247 -> 283 TFLOP/s at 128 x 1024 x 128)
                        const uint32_t keep = 0u - (uint32_t)pair_bit(bits, i);
                        const float hv = h_s * sacc[i], t = tanh_approx(hv), w = fmaf(t, kz, kz);
                        sacc[i] = __uint_as_float(__float_as_uint(fmaf(hv, t, hv)) & keep);
                        dpacc[i] = __uint_as_float(__float_as_uint(dpacc[i] * fmaf(w, fmaf(-hv, t, hv), w)) & keep);
                    }
                }
                uint32_t pp[QN / 16][4], pz[QN / 16][4];  // P^T, dZ^T as A fragments (keys x 16 queries)
#pragma unroll
                for (int kk = 0; kk < QN / 16; ++kk)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        pp[kk][r] = pack2<T>(sacc[8 * kk + 2 * r], sacc[8 * kk + 2 * r + 1]);
                        pz[kk][r] = pack2<T>(dpacc[8 * kk + 2 * r], dpacc[8 * kk + 2 * r + 1]);
                    }
                // dZ^T -> Zt as dZ (query rows, keys along the row; this warpgroup's 64 keys = panel cw, or at
                // D = 256 the block's 64 keys = panel 0, which both warpgroups hold: warpgroup cw stores its
                // query rows qw0.., and its P^T into Pt the same way):
                // fragment r of step kk is the 8 x 8 block (keys 16 warp + 8 (r & 1), queries qw0 + 16 kk + 8 (r >> 1))
                {
                    const int m = lane / 8, i = lane % 8;
                    const int kb = 16 * warp + 8 * (m & 1);  // key within the panel
                    const uint32_t zp = smem_u32(Zt) + (C::COL_SPLIT ? 0 : cw) * kBQ * 128;
#pragma unroll
                    for (int kk = 0; kk < QN / 16; ++kk) {
                        const int row = qw0 + 16 * kk + 8 * (m >> 1) + i;
                        const uint32_t off = row * 128 + (((kb / 8) ^ (row % 8)) * 16);
                        stmatrix_x4_trans(zp + off, pz[kk]);
                        if constexpr (C::COL_SPLIT) stmatrix_x4_trans(smem_u32(Pt) + off, pp[kk]);
                    }
                }
                fence_proxy_async();
                // the column split: both warpgroups' halves of P and dZ stored before either reads them; DZ:
                // both warpgroups' parts of dZ stored before the copy reads them
                if constexpr (DZ) {
                    if (threadIdx.x == 128) bulk_wait_group_read0();  // the previous tile's copy has read its Z buffer
                    named_bar_sync(2);
                    if (threadIdx.x == 128) {
                        const int q_tiles = (int)((p.max_seq_len + kBQ - 1) / kBQ);
                        const int64_t slot = ((int64_t)(w.b * (int)p.H + h) * k_tiles + k0 / kBN) * q_tiles + q0 / kBQ;
                        bulk_store(p.dz, slot * C::Z_BYTES, smem_u32(Zt), C::Z_BYTES);
                        bulk_commit_group();
                    }
                } else if constexpr (C::COL_SPLIT) {
                    named_bar_sync(2);
                }
                tf_wgmma_fence();
                // dV[:, nc0..] += P^T dO[:, nc0..], dK[:, nc0..] += dZ^T Q[:, nc0..]: a column half at D = 256 is
                // panels 2 cw, 2 cw + 1 (kBQ rows each), contiguous; P^T and dZ^T from the stored tiles there
                if constexpr (C::COL_SPLIT) {
                    tf_gemm_ss_tt<T, NC, kBQ>(dv, smem_u32(Pt), smem_u32(Ot) + (nc0 / 64) * kBQ * 128);
                    tf_gemm_ss_tt<T, NC, kBQ>(dk, smem_u32(Zt), smem_u32(Qt) + (nc0 / 64) * kBQ * 128);
                } else {
                    tf_gemm_rs<T, NC, kBQ>(dv, pp, smem_u32(Ot) + (nc0 / 64) * kBQ * 128);
                    tf_gemm_rs<T, NC, kBQ>(dk, pz, smem_u32(Qt) + (nc0 / 64) * kBQ * 128);
                }
                tf_wgmma_commit();
                if constexpr (DZ) {  // no dQ here: the stage goes back once dK and dV have read it
                    tf_wgmma_wait<0>();
                    tf_wgmma_reg_fence(dk);
                    tf_wgmma_reg_fence(dv);
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty_bar[st]);
                    continue;  // the tile
                }
                // dQ = dZ K: every warp's dZ must be in Zt first (both warpgroups' when they split the columns).
                // TMA dQ path: the barrier also orders this warpgroup's staging writes below after the read of
                // the previous tile's reduce, which its issuing thread waits for here (long done: a tile ago).
                // Every thread waits (no bulk groups: at once; the red path has none): a branch between the
                // wgmma fence above and the dQ wgmma makes ptxas inject another fence (C7519)
                if constexpr (C::DQ_TMA) bulk_wait_group_read0();
                if constexpr (C::COL_SPLIT) {
                    // passed above
                } else if constexpr (C::DQ_SPLIT_N) {
                    named_bar_sync(2);
                } else {
                    named_bar_sync_n(3 + cw, 128);
                }
                const uint32_t z_addr = smem_u32(Zt);
                const int dqk = (int)p.dqk;
                if constexpr (C::COL_SPLIT) {
                    // both 64-column chunks of this warpgroup's dQ columns issued at once (64 registers: P^T
                    // and dZ^T are not held past their stores)
                    float dq[2][32];
#pragma unroll
                    for (int n = 0; n < 2; ++n) {
                        const int pc = 2 * cw + n;
#pragma unroll
                        for (int kk = 0; kk < kBN / 16; ++kk)
                            wgmma_ss_tb<T, 64>(dq[n], tf_wgmma_desc(z_addr + (kk / 4) * kBQ * 128 + (kk % 4) * 32, 0),
                                               tf_wgmma_desc(k_addr + pc * kBN * 128 + kk * 16 * 128, kBN * 128), kk > 0);
                        tf_wgmma_commit();
                    }
                    if (dq_tma) {
                        tf_wgmma_wait<0>();
                        tf_wgmma_reg_fence(dq[0]);
                        tf_wgmma_reg_fence(dq[1]);
                        tf_wgmma_reg_fence(dk);
                        tf_wgmma_reg_fence(dv);
                        // Since barrier 2 this warpgroup's wgmmas alone read its column half of the stage's Q and
                        // dO (panels 2 cw, 2 cw + 1 of each; S^T and dP^T, which read every panel, completed
                        // before), and they have completed: those four 8 KB panels stage its 64 x 128 fp32 dQ
                        // as four 32-column boxes (chunk 0 in Q's, chunk 1 in dO's; the layout of the TMA path
                        // above, see there), added by TMA reduce-adds. The stage goes back to the producer
                        // (empty_bar) once they have been read.
                        const int qp = kBQ * 128;  // a panel's bytes = a box's
#pragma unroll
                        for (int n = 0; n < 2; ++n) {
                            dq_stage(smem_u32(n == 0 ? Qt : Ot) + 2 * cw * qp, dq[n], qp, warp, g, t4, q0, len);
                        }
                        fence_proxy_async();  // the stores -> the reduces' (async proxy) reads
                        named_bar_sync_n(7 + cw, 128);
                        if (threadIdx.x % 128 == 0) {
                            const int row = (int)(w.start + q0);
#pragma unroll
                            for (int n = 0; n < 2; ++n) {
                                const uint32_t dqs = smem_u32(n == 0 ? Qt : Ot) + 2 * cw * qp;
                                const int col0 = 64 * (2 * cw + n);
                                if (col0 < dqk) tma_reduce_add(&tm_dq, dqs, col0, h, row);
                                if (col0 + 32 < dqk) tma_reduce_add(&tm_dq, dqs + qp, col0 + 32, h, row);
                            }
                            bulk_commit_group();
                            stage_read = st;  // handed back at the next tile, once the reduces have read it
                        }
                        // this warp is done with the stage (warp 0: once the reduces have read it, above)
                        if (warp != 0 && lane == 0) mbar_arrive(&empty_bar[st]);
                        continue;  // the tile
                    }
                    // red.global.add from the registers; the first chunk's overlaps the second's wgmma
                    tf_wgmma_wait<1>();  // dK += .., dV += .. and chunk 0
                    tf_wgmma_reg_fence(dq[0]);
                    tf_wgmma_reg_fence(dk);
                    tf_wgmma_reg_fence(dv);
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty_bar[st]);  // this warp is done with the stage's Q and dO
#pragma unroll
                    for (int n = 0; n < 2; ++n) {
                        if (n == 1) {
                            tf_wgmma_wait<0>();
                            tf_wgmma_reg_fence(dq[1]);
                        }
                        dq_red(p.dq_acc, w.start, p.H, h, dqk, 64 * (2 * cw + n), dq[n], warp, g, t4, q0, len);
                    }
                } else {
#pragma unroll
                    for (int n = 0; n < C::DQ_CHUNKS; ++n) {
                        float dq[32];
                        // column panel pc of K (dQ columns 64 pc..): DQ_SPLIT_N: this warpgroup's DQ_CHUNKS panels
                        const int pc = C::DQ_CHUNKS * cw + n;
                        if (n > 0) tf_wgmma_fence();  // the previous chunk's dq registers were read since
                        if constexpr (C::DQ_SPLIT_N) {  // columns 64 pc.., all kBN keys
#pragma unroll
                            for (int kk = 0; kk < kBN / 16; ++kk)
                                wgmma_ss_tb<T, 64>(dq, tf_wgmma_desc(z_addr + (kk / 4) * kBQ * 128 + (kk % 4) * 32, 0),
                                                   tf_wgmma_desc(k_addr + pc * kBN * 128 + kk * 16 * 128, kBN * 128), kk > 0);
                        } else {  // all 64 columns, this warpgroup's 64 keys
#pragma unroll
                            for (int kk = 0; kk < 4; ++kk)
                                wgmma_ss_tb<T, 64>(dq, tf_wgmma_desc(z_addr + cw * kBQ * 128 + kk * 32, 0),
                                                   tf_wgmma_desc(k_addr + (64 * cw + 16 * kk) * 128, kBN * 128), kk > 0);
                        }
                        tf_wgmma_commit();
                        tf_wgmma_wait<0>();
                        tf_wgmma_reg_fence(dq);
                        if (n == 0) {  // the wait covered dK += .., dV += .. too
                            tf_wgmma_reg_fence(dk);
                            tf_wgmma_reg_fence(dv);
                            __syncwarp();
                            if (lane == 0) mbar_arrive(&empty_bar[st]);  // this warp is done with the stage's Q and dO
                        }

                        const int col0 = C::DQ_SPLIT_N ? 64 * pc : 0;
                        if constexpr (C::DQ_TMA) {
                            if (dq_tma) {
                                // The 64 x 64 fragment -> this warpgroup's staging tile: columns 32 b.. in box b,
                                // rows of 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8) (the TMA's 128-byte
                                // swizzle); element 4 j + 2 hh + e: row 16 warp + g + 8 hh (so r % 8 = g), column
                                // 8 j + 2 t4 + e = box j / 4, chunk 2 (j % 4) + t4 / 2, byte 8 (t4 % 2) + 4 e.
                                // A warp's 8-byte store (fixed j, hh): the 8 rows' two chunks (2 (j % 4) + {0, 1}) ^ g
                                // cover each of the 8 chunk positions (bank groups) twice: 256 bytes in 2 wavefronts,
                                // no conflict beyond that.
                                // Rows at or past the sequence's end (pos >= len) are stored as 0: the reduce adds
                                // all 64 rows (the copy engine clips only at L), and those are the next sequence's.
                                // The arithmetic alone gives 0 there only if this sequence's own K and V are finite:
                                // dZ^T's columns pos >= len are 0 (Q and dO tail rows are zeroed in shared memory
                                // above; a masked tile selects 0 for them, hstu_col_bits having no bits past len; a
                                // tile tf_hstu_tile_full reports has keys below its first query only, so < len,
                                // and its dP^T = V dO^T = V . 0, z = alpha K . 0 = 0 there, 0 unless V has inf /
                                // NaN), and dQ = dZ K is then 0 x K over the tile's keys (K's rows past len zeroed,
                                // the others this sequence's): inf / NaN in this sequence's own K or V (the
                                // neighbour-isolation test's middle sequence) would give NaN, so the select does it.
                                // Address: (2 (j % 4) + t4 / 2) ^ g = (32 (j % 4) ^ 16 (t4 / 2 ^ g)) / 16, the
                                // bits of 2 (j % 4) and t4 / 2 not overlapping
                                const uint32_t dqs = smem_u32(DQs + cw * C::DQ_WG_BYTES);
                                dq_stage(dqs, dq, C::DQ_BOX_BYTES, warp, g, t4, q0, len);
                                fence_proxy_async();  // the stores -> the reduce's (async proxy) reads
                                named_bar_sync_n(7 + cw, 128);
                                if (threadIdx.x % 128 == 0) {
                                    // rows w.start + q0.. (clipped at L), columns col0 + 32 b (clipped at dqk:
                                    // a box wholly past it is not issued)
                                    const int row = (int)(w.start + q0);
                                    if (col0 < dqk) tma_reduce_add(&tm_dq, dqs, col0, h, row);
                                    if (col0 + 32 < dqk) tma_reduce_add(&tm_dq, dqs + C::DQ_BOX_BYTES, col0 + 32, h, row);
                                    bulk_commit_group();
                                }
                                continue;  // n: the only chunk
                            }
                        }
                        dq_red(p.dq_acc, w.start, p.H, h, dqk, col0, dq, warp, g, t4, q0, len);
                    }
                }
            }
            // this item's last wgmma reading K or V has completed (the last tile's dQ wait, every chunk):
            // the producer may load the next item's K and V over them while these dK / dV are stored
            __syncwarp();
            if (lane == 0) mbar_arrive(&kv_empty);

            // dK, dV of this thread's keys (this warpgroup's columns nc0 .. nc0 + NC - 1); dV's 1 / S (P^T had none)
#pragma unroll
            for (int i = 0; i < NC / 2; ++i) dv[i] *= (float)p.inv_scale;
            T *dkp = (T *)p.dk, *dvp = (T *)p.dvv;
            const int dqk = (int)p.dqk, dvd = (int)p.dv;
            if (vec_store) {
                // A quad (t4 = 0..3) holds columns 8 j .. 8 j + 7 of a row, two per thread: a 4 x 4 transpose
                // by shuffles gives thread t4 all eight of j = 4 m + t4, one 16-byte store. A warp's store
                // then covers 8 rows x 64 contiguous bytes (whole sectors) where the 4-byte stores below
                // cover 8 x 16: those stores took 18% of the consumers' time at 128 x 1024. The launch
                // checks dqk, dv (multiples of 8) and alignment.
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int key = key_a + 8 * hh;
                    T *dkr = dkp + (w.start + key) * p.dk_sr + h * dqk, *dvr = dvp + (w.start + key) * p.dv_sr + h * dvd;
#pragma unroll
                    for (int m = 0; m < NC / 32; ++m) {
                        const uint4 ck = quad_chunk<T>(dk, hh, m), cv = quad_chunk<T>(dv, hh, m);  // every lane
                        const int col = nc0 + 8 * (4 * m + t4);
                        if (key < len && col < dqk) *(uint4 *)(dkr + col) = ck;
                        if (key < len && col < dvd) *(uint4 *)(dvr + col) = cv;
                    }
                }
            } else {  // 4-byte stores of the accumulator layout
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int key = key_a + 8 * hh;
                    if (key >= len) continue;
                    T *dkr = dkp + (w.start + key) * p.dk_sr + h * dqk, *dvr = dvp + (w.start + key) * p.dv_sr + h * dvd;
#pragma unroll
                    for (int j = 0; j < NC / 8; ++j) {
                        const int col = nc0 + 8 * j + 2 * t4;
                        if (col < dqk) *(uint32_t *)(dkr + col) = pack2<T>(dk[4 * j + 2 * hh], dk[4 * j + 2 * hh + 1]);
                        if (col < dvd) *(uint32_t *)(dvr + col) = pack2<T>(dv[4 * j + 2 * hh], dv[4 * j + 2 * hh + 1]);
                    }
                }
            }
        }
        // the block's last dQ reduces: complete before it ends (they read its shared memory until then)
        if ((dq_tma && threadIdx.x % 128 == 0) || (DZ && threadIdx.x == 128)) bulk_wait_group0();
    }
#endif
}

#if defined(TF_BUILT_SM90A)
/* The tensor maps of q, k, v and dout (false: the copy engine cannot address them). */
bool qkvo_maps(const tf_hstu_params &p, int kBN, CUtensorMap *tq, CUtensorMap *tk, CUtensorMap *tv, CUtensorMap *tdo) {
    return tensor_map(tq, p.dtype, p.q, p.L, p.H, p.dqk, p.q_sr, p.q_sh, kBQ) &&
           tensor_map(tk, p.dtype, p.k, p.L, p.H, p.dqk, p.k_sr, p.k_sh, kBN) &&
           tensor_map(tv, p.dtype, p.v, p.L, p.H, p.dv, p.v_sr, p.v_sh, kBN) &&
           tensor_map(tdo, p.dtype, p.dout, p.L, p.H, p.dv, p.do_sr, p.do_sh, kBQ);
}

/* -1: the copy engine cannot address these tensors (the caller falls back to mma.sync) */
template <typename T, int D, bool DZ>
int launch(const tf_hstu_params &p, cudaStream_t stream) {
    constexpr int kBN = BwdSm90Cfg<D>::BN;
    const int64_t k_tiles = (p.max_seq_len + kBN - 1) / kBN, items = k_tiles * p.B * p.H;
    if (items == 0) return 0;
    if (items > 0x7fff0000 || !p.sched) return -1;  // item numbers (and the counter, up to items + grid) are ints
    CUtensorMap tq, tk, tv, tdo;
    if (!qkvo_maps(p, kBN, &tq, &tk, &tv, &tdo)) return -1;
    // dQ: staged in shared memory and added by TMA reduce-adds where p.dq_acc's map can be made (staging
    // tiles of its own up to head dim 128, the ring's panels at 192 / 256), else red.global.add from the
    // registers
    CUtensorMap tdq;
    memset(&tdq, 0, sizeof(tdq));  // unread on the red path
    const bool dq_tma = !DZ && (BwdSm90Cfg<D>::DQ_TMA || BwdSm90Cfg<D>::COL_SPLIT) &&
                        tensor_map_f32_reduce(&tdq, p.dq_acc, p.L, p.H, p.dqk, kBQ);
    const int smem = dq_tma ? BwdSm90Cfg<D>::SMEM_TMA : BwdSm90Cfg<D>::SMEM;
    cudaError_t err = cudaFuncSetAttribute(hstu_bwd_ws<T, D, DZ>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    const int section = l2_section(p.max_seq_len * (p.dqk + p.dv) * 2, p.B * p.H, (int)k_tiles);
    // persistent: one block per SM (one fits: shared memory), each taking items from p.sched, zeroed
    // here on the stream
    const int64_t grid = items < device_sizes().sms ? items : device_sizes().sms;
    err = cudaMemsetAsync(p.sched, 0, sizeof(int), stream);
    if (err != cudaSuccess) return err;
    // dK / dV by 16-byte stores where rows and columns allow (head dims that are multiples of 8, aligned
    // outputs), else 4-byte stores
    const bool vec = p.dqk % 8 == 0 && p.dv % 8 == 0 && p.dk_sr % 8 == 0 && p.dv_sr % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(p.dk) % 16 == 0 && reinterpret_cast<uintptr_t>(p.dvv) % 16 == 0;
    hstu_bwd_ws<T, D, DZ><<<(unsigned)grid, kThreads, smem, stream>>>(tq, tk, tv, tdo, tdq, p, (int)k_tiles, section,
                                                                      (int)items, (dq_tma ? 1 : 0) | (vec ? 2 : 0));
    return cudaGetLastError();
}

/* The two-part backward (p.dz set: tf_hstu_bwd_sm90_dz_bytes said it applies): per chunk of p.dz_seqs
 * sequences (the offsets and targets pointers moved to the chunk's first; rows stay absolute), the
 * backward storing dZ's tiles into p.dz, then dQ = dZ K from them. The chunks run one after another on
 * the stream, reusing p.dz. */
template <typename T>
int launch_two_part(const tf_hstu_params &p, cudaStream_t stream) {
    for (int64_t b0 = 0; b0 < p.B; b0 += p.dz_seqs) {
        tf_hstu_params c = p;
        c.B = p.B - b0 < p.dz_seqs ? p.B - b0 : p.dz_seqs;
        c.offsets = (const char *)p.offsets + b0 * (p.offsets_i64 ? 8 : 4);
        if (p.num_targets) c.num_targets = (const char *)p.num_targets + b0 * (p.targets_i64 ? 8 : 4);
        int err = hstu_two_part_head_dim(p, [&](auto D) { return launch<T, decltype(D)::value, true>(c, stream); });
        if (err != 0) return err == -1 ? (int)cudaErrorInvalidValue : err;  // dz_bytes checked what launch needs
        err = tf_hstu_bwd_dq_sm90(&c, stream);
        if (err != 0) return err;
    }
    return 0;
}

template <typename T>
int dispatch(const tf_hstu_params &p, cudaStream_t stream) {
    if (p.dz) return launch_two_part<T>(p, stream);
    return hstu_with_head_dim(p, [&](auto D) {
        return launch<T, decltype(D)::value, false>(p, stream);
    });
}
#endif

}  // namespace

extern "C" int tf_hstu_bwd_sm90(const tf_hstu_params *p, void *stream) {
#if defined(TF_BUILT_SM90A)
    if (p->dtype != TF_BF16 && p->dtype != TF_F16) return -1;
    if (p->backend == TF_HSTU_MMA) return -1;
    if (p->bias || (!p->dq_acc && !p->dz) || p->delta > 0) return -1;
    if ((p->dqk > p->dv ? p->dqk : p->dv) > 256 || !device_is_sm90()) return -1;
    if (p->dtype == TF_BF16) return dispatch<__nv_bfloat16>(*p, (cudaStream_t)stream);
    return dispatch<__half>(*p, (cudaStream_t)stream);
#else
    (void)p;
    (void)stream;
    return -1;
#endif
}

extern "C" int64_t tf_hstu_bwd_sm90_dz_bytes(const tf_hstu_params *p, int64_t cap, int64_t *seqs) {
    *seqs = 0;
#if defined(TF_BUILT_SM90A)
    const int64_t d = p->dqk > p->dv ? p->dqk : p->dv;
    if ((p->dtype != TF_BF16 && p->dtype != TF_F16) || p->backend == TF_HSTU_MMA || p->bias || p->delta > 0 ||
        p->dropout_p > 0 || d <= 64 || d > 256 || p->B <= 0 || p->H <= 0 || p->L <= 0 || !device_is_sm90())
        return 0;
    // one (sequence, head) pair's (key tile, 64-row query tile) grid of kBN x 64 dZ tiles (those its mask
    // reaches are written); kBN: the backward's key tile
    const int kBN = hstu_two_part_head_dim(*p, [](auto D) { return BwdSm90Cfg<decltype(D)::value>::BN; });
    const int64_t k_tiles = (p->max_seq_len + kBN - 1) / kBN, q_tiles = (p->max_seq_len + kBQ - 1) / kBQ;
    const int64_t per_seq = p->H * k_tiles * q_tiles * (int64_t)(kBQ * kBN * 2);
    if (k_tiles <= 0 || per_seq > cap || q_tiles * p->B * p->H > 0x7fff0000) return 0;
    CUtensorMap tq, tk, tv, tdo;
    if (!qkvo_maps(*p, kBN, &tq, &tk, &tv, &tdo)) return 0;
    *seqs = cap / per_seq < p->B ? cap / per_seq : p->B;
    return *seqs * per_seq;
#else
    (void)p;
    (void)cap;
    return 0;
#endif
}
