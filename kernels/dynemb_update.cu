// Dynamic embedding, CUDA: the optimizer update of rows, the per-id gradient sums over a batch's
// segments, and the two fused.

#include "dynemb_common.cuh"

namespace {

/* The optimizer's step on one element of a row: returns the new weight; s1 / s2 are the element's
 * state (Adagrad: s1; Adam: s1, s2), updated. rw_mult: RowWiseAdagrad's step (rowwise_mult).
 * Every operation is rounded explicitly (no fused multiply-add), as the CPU's C computes it: the
 * compiler contracts a * b + c into one FMA or not depending on the code around it, and this step
 * inlines into several kernels (update_kernel, the fused segment-sum updates), which must give a
 * row the same bits for the same gradient. */
__device__ __forceinline__ float opt_step(const tf_dynemb_update_params &p, int opt, float w, float g, float &s1,
                                          float &s2, float rw_mult) {
    switch (opt) {
    case TF_OPT_SGD: return __fsub_rn(w, __fmul_rn(p.lr, g));
    case TF_OPT_ADAGRAD:
        s1 = __fadd_rn(s1, __fmul_rn(g, g));
        return __fsub_rn(w, __fdiv_rn(__fmul_rn(p.lr, g), __fadd_rn(__fsqrt_rn(s1), p.eps)));
    case TF_OPT_ROWWISE_ADAGRAD: return __fsub_rn(w, __fmul_rn(rw_mult, g));
    default: {  // Adam, in torch.optim.SparseAdam's form
        const float m = __fadd_rn(s1, __fmul_rn(__fsub_rn(g, s1), 1.f - p.beta1));
        const float v = __fadd_rn(s2, __fmul_rn(__fsub_rn(__fmul_rn(g, g), s2), 1.f - p.beta2));
        s1 = m;
        s2 = v;
        return __fadd_rn(w, __fmul_rn(-p.step_size, __fdiv_rn(m, __fadd_rn(__fsqrt_rn(v), p.eps))));
    }
    }
}

/* RowWiseAdagrad: sq is this lane's sum of its columns' squared gradients; the warp's total over the
 * row updates the row's one state float (the running mean square) and gives lr / (sqrt(m) + eps). */
__device__ __forceinline__ float rowwise_mult(const tf_dynemb_update_params &p, float *st, float sq, int lane) {
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    const float m = __fadd_rn(st[0], __fdiv_rn(sq, static_cast<float>(p.dim)));
    __syncwarp();
    if (lane == 0) st[0] = m;
    return __fdiv_rn(p.lr, __fadd_rn(__fsqrt_rn(m), p.eps));
}

__device__ __forceinline__ void update_one(const tf_dynemb_update_params &p, int64_t i, int lane) {
    const int64_t slot = p.slots[i];
    if (slot < 0) return;
    const int64_t dim = p.dim;
    char *row = tf_dynemb_row(&p.values, slot);
    float *st = p.state.row_bytes ? reinterpret_cast<float *>(tf_dynemb_row(&p.state, slot)) : nullptr;
    const int64_t g0 = i * p.grad_stride;
    float rw_mult = 0.f;
    if (p.opt == TF_OPT_ROWWISE_ADAGRAD) {
        float sq = 0.f;
        for (int64_t j = lane; j < dim; j += 32) {
            const float g = load_f32(p.grad, p.grad_dtype, g0 + j);
            sq = __fadd_rn(sq, __fmul_rn(g, g));
        }
        rw_mult = rowwise_mult(p, st, sq, lane);
    }
    // Four elements per lane at a time, every load issued before the first store (the compiler may
    // not move a load above a store that could alias it: one round trip per element otherwise).
    const bool st1 = p.opt == TF_OPT_ADAGRAD || p.opt == TF_OPT_ADAM, st2 = p.opt == TF_OPT_ADAM;
    for (int64_t j0 = lane; j0 < dim; j0 += 4 * 32) {
        float g[4], w[4], s1[4], s2[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int64_t j = j0 + 32 * k;
            g[k] = w[k] = s1[k] = s2[k] = 0.f;
            if (j < dim) {
                g[k] = load_f32(p.grad, p.grad_dtype, g0 + j);
                w[k] = load_f32(row, p.dtype, j);
                if (st1) s1[k] = st[j];
                if (st2) s2[k] = st[dim + j];
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int64_t j = j0 + 32 * k;
            if (j >= dim) break;
            w[k] = opt_step(p, p.opt, w[k], g[k], s1[k], s2[k], rw_mult);
            if (st1) st[j] = s1[k];
            if (st2) st[dim + j] = s2[k];
            store_f32(row, p.dtype, j, w[k]);
        }
    }
}

template <int N>
__global__ void update_kernel(const __grid_constant__ Tables<tf_dynemb_update_params, N> g) {
    warp_item(g, [](const tf_dynemb_update_params &a, int64_t i, int lane) { update_one(a, i, lane); });
}

/* Segment sum in two steps (see tf_dynemb_segsum_params). Step 1: one warp per chunk of
 * TF_DYNEMB_SEG_CHUNK consecutive occurrences (perm order), lanes over columns. The lanes first load
 * the chunk's (source row, scale) pairs, one per lane, then walk the occurrences in order, taking each
 * pair from its lane by shuffle, so a step costs one row load instead of three dependent loads.
 * A run of one id that lies wholly inside the chunk is written to out; a run cut by the chunk's
 * edge is written to partial: slot 0 when the id began in an earlier chunk, slot 1 when it begins
 * here and goes on. */
// ---- segment sum: shared pieces of the chunk kernels ----

// Occurrences [q0, q1) of chunk k (q0 < n_occ checked by the caller).
__device__ __forceinline__ int64_t seg_chunk_end(const tf_dynemb_segsum_params &p, int64_t q0) {
    return q0 + TF_DYNEMB_SEG_CHUNK < p.n_occ ? q0 + TF_DYNEMB_SEG_CHUNK : p.n_occ;
}

// The id of occurrence q: the last u with seg[u] <= q. Warp-collective (all 32 lanes, the same q):
// each round the lanes probe 32 evenly spaced ids of the range left and keep the part between the
// last probe at or below q and the next, so a million ids take 4 dependent loads, not 20 (the
// chunk kernels' prologue, before any row is loaded, was a 20-load chain per warp).
__device__ __forceinline__ int64_t seg_id_of(const tf_dynemb_segsum_params &p, int64_t q, int lane) {
    int64_t lo = 0, hi = p.n_unique - 1;  // the answer lies in [lo, hi]; seg[lo] <= q
    while (lo < hi) {
        const int64_t step = (hi - lo + 32) / 32;  // ceil((hi - lo + 1) / 32) >= 1
        const int64_t pos = lo + (lane + 1) * step;
        // seg is non-decreasing, so the lanes whose probe is at or below q are a prefix
        const unsigned ok = __ballot_sync(0xffffffffu, pos <= hi && p.seg[pos] <= q);
        const int c = __popc(ok);
        const int64_t next_lo = lo + c * step;
        hi = next_lo + step - 1 < hi ? next_lo + step - 1 : hi;
        lo = next_lo;
    }
    return lo;
}

// Lane l's (source row, scale) of occurrence q0 + l, handed round by shuffle as the chunk is walked.
__device__ __forceinline__ void seg_lane_pair(const tf_dynemb_segsum_params &p, int64_t q0, int64_t q1, int lane,
                                              int64_t &src, float &scale) {
    src = 0;
    scale = 0.f;
    if (q0 + lane < q1) {
        const int64_t i = p.perm[q0 + lane];
        src = p.bag_of ? p.bag_of[i] : i;
        scale = p.scale ? p.scale[i] : 1.f;
    }
}

/* The id whose run chunk k (occurrences [q0, q1)) must join, or -1: the run of its last occurrence,
 * when it begins in this chunk and goes on past it; *k1 = the chunk where that run ends. */
__device__ __forceinline__ int64_t seg_cut_run(const tf_dynemb_segsum_params &p, int64_t q0, int64_t q1, int lane,
                                               int64_t *k1) {
    const int64_t u = seg_id_of(p, q1 - 1, lane);
    const int64_t a = p.seg[u], b = p.seg[u + 1];
    if (a < q0 || b <= q1) return -1;  // began in an earlier chunk (joined there), or ends in this one
    *k1 = (b - 1) / TF_DYNEMB_SEG_CHUNK;
    return u;
}

// Rows of p.partial (tf_dynemb_seg_partial_rows): slot s of chunk k at 2k + s, then the sums of
// whole groups of FAN chunks (level 1), then of FAN^2 chunks (level 2).
__device__ __forceinline__ const float *seg_level_row(const tf_dynemb_segsum_params &p, int level, int64_t i) {
    const int64_t c = tf_dynemb_seg_chunks(p.n_occ);
    const int64_t row = level == 0 ? 2 * i : level == 1 ? 2 * c + i : 2 * c + c / TF_DYNEMB_SEG_FAN + i;
    return p.partial + row * p.dim;
}

// The gradient of a run cut by chunk edges, from its first chunk k to chunk k1, at the columns
// c0 + 32 j (j < NC) of this lane: chunk k's slot-1 sum, then the later chunks' slot-0 sums, taken a
// level-2 or level-1 group at a time where the group lies wholly in (k, k1] (seg_level_kernel wrote
// those sums), else one chunk at a time. A hot id's run of 10^5 occurrences is then a chain of about
// a hundred adds, not thousands (one warp walking 1.7k chunk sums took 1.9 of a 3.3 ms SGD step on a
// Zipf batch).
template <int NC>
__device__ __forceinline__ void seg_joined(const tf_dynemb_segsum_params &p, int64_t k, int64_t k1, int64_t c0,
                                           float acc[NC]) {
    constexpr int64_t kFan = TF_DYNEMB_SEG_FAN, kFan2 = kFan * kFan;
    const float *first = seg_level_row(p, 0, k) + p.dim;  // slot 1
#pragma unroll
    for (int j = 0; j < NC; ++j) acc[j] = c0 + 32 * j < p.dim ? first[c0 + 32 * j] : 0.f;
    for (int64_t kk = k + 1; kk <= k1;) {
        const float *row;
        if (kk % kFan2 == 0 && kk + kFan2 - 1 <= k1) {
            row = seg_level_row(p, 2, kk / kFan2);
            kk += kFan2;
        } else if (kk % kFan == 0 && kk + kFan - 1 <= k1) {
            row = seg_level_row(p, 1, kk / kFan);
            kk += kFan;
        } else {
            row = seg_level_row(p, 0, kk);  // slot 0
            kk += 1;
        }
#pragma unroll
        for (int j = 0; j < NC; ++j)
            if (c0 + 32 * j < p.dim) acc[j] += row[c0 + 32 * j];
    }
}

/* The level sums seg_joined reads: one warp per group g of FAN chunks (level 1: chunks [FAN g,
 * FAN g + FAN)) or of FAN level-1 groups (level 2), lanes over columns. A group is summed, in order,
 * only when every chunk in it begins inside one run that began in an earlier chunk (then each chunk's
 * slot 0 is a part of that run); other groups are never read. */
__global__ void seg_level_kernel(tf_dynemb_segsum_params p, int level) {
    const int64_t g = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t span = level == 1 ? TF_DYNEMB_SEG_FAN : TF_DYNEMB_SEG_FAN * TF_DYNEMB_SEG_FAN;
    if (g >= tf_dynemb_seg_chunks(p.n_occ) / span) return;
    const int64_t q = g * span * TF_DYNEMB_SEG_CHUNK;  // the group's first occurrence
    const int64_t u = seg_id_of(p, q, lane);
    if (!(p.seg[u] < q && (p.seg[u + 1] - 1) / TF_DYNEMB_SEG_CHUNK >= (g + 1) * span - 1)) return;
    float *out = const_cast<float *>(seg_level_row(p, level, g));
    const int64_t first = g * TF_DYNEMB_SEG_FAN;  // its first chunk's slot 0 (level 1) or level-1 row (level 2)
    for (int64_t c = lane; c < p.dim; c += 32) {
        float v[TF_DYNEMB_SEG_FAN];
#pragma unroll
        for (int t = 0; t < TF_DYNEMB_SEG_FAN; ++t) v[t] = seg_level_row(p, level - 1, first + t)[c];
        float acc = v[0];
#pragma unroll
        for (int t = 1; t < TF_DYNEMB_SEG_FAN; ++t) acc += v[t];
        out[c] = acc;
    }
}

// Launches seg_level_kernel for the levels a batch of n_occ occurrences can use: a level-1 group
// lies inside a run only after that run's first chunk, so the first group never does.
static void seg_levels_launch(const tf_dynemb_segsum_params &p, cudaStream_t s) {
    const int64_t chunks = tf_dynemb_seg_chunks(p.n_occ);
    for (int level = 1; level <= 2; ++level) {
        const int64_t groups = chunks / (level == 1 ? TF_DYNEMB_SEG_FAN : TF_DYNEMB_SEG_FAN * TF_DYNEMB_SEG_FAN);
        if (groups >= 2) seg_level_kernel<<<grid_for_warps(groups), kBlock, 0, s>>>(p, level);
    }
}

// Columns per lane per pass over a chunk (a pass covers 32 kSegCols columns; wider rows take more).
constexpr int kSegCols = 4;

__global__ void segsum_chunk_kernel(tf_dynemb_segsum_params p) {
    const int64_t k = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t q0 = k * TF_DYNEMB_SEG_CHUNK;
    if (q0 >= p.n_occ) return;
    const int64_t q1 = seg_chunk_end(p, q0);
    int64_t my_src;
    float my_scale;
    seg_lane_pair(p, q0, q1, lane, my_src, my_scale);
    const int64_t lo = seg_id_of(p, q0, lane);
    for (int64_t c0 = 0; c0 < p.dim; c0 += 32 * kSegCols) {
        float acc[kSegCols];
#pragma unroll
        for (int j = 0; j < kSegCols; ++j) acc[j] = 0.f;
        int64_t u = lo, u_begin = p.seg[u], u_end = p.seg[u + 1];
        // Four occurrences' rows are loaded before any is summed: runs are mostly one occurrence
        // long, and a run's store would otherwise hold back the next row's load.
        for (int64_t qb = q0; qb < q1; qb += 4) {
            float v[4][kSegCols];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int64_t q = qb + r;
                const int64_t src = __shfl_sync(0xffffffffu, my_src, (int)((q < q1 ? q : q0) - q0));
#pragma unroll
                for (int j = 0; j < kSegCols; ++j) {
                    const int64_t c = c0 + lane + 32 * j;
                    v[r][j] = q < q1 && c < p.dim ? load_f32(p.grad, p.grad_dtype, src * p.dim + c) : 0.f;
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int64_t q = qb + r;
                if (q >= q1) break;
                const float s = __shfl_sync(0xffffffffu, my_scale, (int)(q - q0));
#pragma unroll
                for (int j = 0; j < kSegCols; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(s, v[r][j]));
                if (q + 1 == u_end || q + 1 == q1) { /* the run of id u ends here */
                    float *dst;
                    if (u_begin >= q0 && u_end <= q1) dst = p.out + u * p.dim;
                    else dst = p.partial + ((2 * k + (u_begin < q0 ? 0 : 1)) * p.dim);
#pragma unroll
                    for (int j = 0; j < kSegCols; ++j) {
                        const int64_t c = c0 + lane + 32 * j;
                        if (c < p.dim) dst[c] = acc[j];
                        acc[j] = 0.f;
                    }
                    if (q + 1 < q1 && u + 1 < p.n_unique) { /* the next id begins at q + 1 (unique ids own non-empty runs) */
                        ++u;
                        u_begin = u_end;
                        u_end = p.seg[u + 1];
                    }
                }
            }
        }
    }
}

/* Step 2: the ids whose run crosses a chunk edge, one warp per chunk: the chunk where such a run
 * begins writes seg_joined's sum into out (after seg_level_kernel). (A warp per unique id cost
 * ~120 us at a million ids, nearly all of them finished by step 1.) */
__global__ void segsum_join_kernel(tf_dynemb_segsum_params p) {
    const int64_t k = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t q0 = k * TF_DYNEMB_SEG_CHUNK;
    if (q0 >= p.n_occ) return;
    int64_t k1;
    const int64_t u = seg_cut_run(p, q0, seg_chunk_end(p, q0), lane, &k1);
    if (u < 0) return;
    for (int64_t c0 = lane; c0 < p.dim; c0 += 32 * kSegCols) {
        float acc[kSegCols];
        seg_joined<kSegCols>(p, k, k1, c0, acc);
#pragma unroll
        for (int j = 0; j < kSegCols; ++j)
            if (c0 + 32 * j < p.dim) p.out[u * p.dim + c0 + 32 * j] = acc[j];
    }
}

/* Ids with an empty run (seg[u] == seg[u + 1]: not produced by unique ids, but defined) get zeros;
 * a thread per id. */
__global__ void segsum_empty_kernel(tf_dynemb_segsum_params p) {
    const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (u >= p.n_unique || p.seg[u + 1] > p.seg[u]) return;
    for (int64_t c = 0; c < p.dim; ++c) p.out[u * p.dim + c] = 0.f;
}

// ---- segment sum fused with the optimizer update (rows of at most 32 kSegCols columns) ----

// Row `slot`'s weights and state at this lane's columns lane + 32 k (zeros past the row).
template <int kOpt>
__device__ __forceinline__ void load_cols(const tf_dynemb_update_params &u, int64_t slot, int lane,
                                          float (&w)[kSegCols], float (&s1)[kSegCols], float (&s2)[kSegCols]) {
    const char *row = tf_dynemb_row(&u.values, slot);
    const float *st = u.state.row_bytes ? reinterpret_cast<const float *>(tf_dynemb_row(&u.state, slot)) : nullptr;
    constexpr bool st1 = kOpt == TF_OPT_ADAGRAD || kOpt == TF_OPT_ADAM, st2 = kOpt == TF_OPT_ADAM;
#pragma unroll
    for (int k = 0; k < kSegCols; ++k) {
        const int64_t j = lane + 32 * k;
        w[k] = s1[k] = s2[k] = 0.f;
        if (j < u.dim) {
            w[k] = load_f32(row, u.dtype, j);
            if (st1) s1[k] = st[j];
            if (st2) s2[k] = st[u.dim + j];
        }
    }
}

// One optimizer step of row `slot` with gradient g (this lane's columns), its row and state already
// in w / s1 / s2: the same arithmetic as update_one. The whole warp calls it. kOpt: u.opt, known at
// compile time so that SGD keeps no state registers.
template <int kOpt>
__device__ __forceinline__ void apply_cols(const tf_dynemb_update_params &u, int64_t slot, int lane,
                                           const float (&g)[kSegCols], float (&w)[kSegCols], float (&s1)[kSegCols],
                                           float (&s2)[kSegCols]) {
    char *row = tf_dynemb_row(&u.values, slot);
    float *st = u.state.row_bytes ? reinterpret_cast<float *>(tf_dynemb_row(&u.state, slot)) : nullptr;
    float rw_mult = 0.f;
    if (kOpt == TF_OPT_ROWWISE_ADAGRAD) {
        float sq = 0.f;
#pragma unroll
        for (int k = 0; k < kSegCols; ++k)
            if (lane + 32 * k < u.dim) sq = __fadd_rn(sq, __fmul_rn(g[k], g[k]));
        rw_mult = rowwise_mult(u, st, sq, lane);
    }
    constexpr bool st1 = kOpt == TF_OPT_ADAGRAD || kOpt == TF_OPT_ADAM, st2 = kOpt == TF_OPT_ADAM;
#pragma unroll
    for (int k = 0; k < kSegCols; ++k) {
        const int64_t j = lane + 32 * k;
        if (j >= u.dim) break;
        w[k] = opt_step(u, kOpt, w[k], g[k], s1[k], s2[k], rw_mult);
        if (st1) st[j] = s1[k];
        if (st2) st[u.dim + j] = s2[k];
        store_f32(row, u.dtype, j, w[k]);
    }
}

/* segsum_chunk_kernel with the update folded in: a run wholly inside the chunk is not written out but
 * applied to its row (u.slots[id]) at once. The lanes first load the chunk's ids' run ends and slots
 * (a chunk of 32 occurrences has at most 32 ids); each step of four occurrences loads, with their
 * gradient rows, the rows of the ids whose runs end in it, so a step waits for one round of loads,
 * not one per id (runs are mostly one occurrence long). Runs cut by the chunk's edges go to the
 * partial sums as in segsum_chunk_kernel, and segsum_update_join_kernel applies them. */
// Registers capped so that SGD and row-wise Adagrad (no per-column state) fit 5 blocks (20 warps)
// per SM and the others 4: the kernel waits on memory (each id's table row read, then written), and
// uncapped SGD took 98 registers, 4 blocks. No spills (ptxas -v).
template <int kOpt>
__global__ void __launch_bounds__(128, kOpt == TF_OPT_SGD || kOpt == TF_OPT_ROWWISE_ADAGRAD ? 5 : 4)
    segsum_update_kernel(tf_dynemb_segsum_params p, tf_dynemb_update_params u) {
    const int64_t k = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t q0 = k * TF_DYNEMB_SEG_CHUNK;
    if (q0 >= p.n_occ) return;
    const int64_t q1 = seg_chunk_end(p, q0);
    int64_t my_src;
    float my_scale;
    seg_lane_pair(p, q0, q1, lane, my_src, my_scale);
    const int64_t lo = seg_id_of(p, q0, lane);
    int64_t my_end = INT64_MAX, my_slot = -1;  // lane l: the end of the run of id lo + l, and its slot
    if (lo + lane < p.n_unique) {
        my_end = p.seg[lo + lane + 1];
        my_slot = u.slots[lo + lane];
    }
    float acc[kSegCols];
#pragma unroll
    for (int j = 0; j < kSegCols; ++j) acc[j] = 0.f;
    int r = 0;  // the current id is lo + r
    int64_t u_begin = p.seg[lo], u_end = __shfl_sync(0xffffffffu, my_end, 0);
    for (int64_t qb = q0; qb < q1; qb += 4) {
        // ids lo + r + b (b < 4) whose run lies in the chunk and ends in this step: their rows now
        float w[4][kSegCols], s1[4][kSegCols], s2[4][kSegCols];
        int64_t slot_b[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int rb = r + b < 31 ? r + b : 31;
            const int64_t end_b = __shfl_sync(0xffffffffu, my_end, rb);
            const int64_t begin_b = b == 0 ? u_begin : __shfl_sync(0xffffffffu, my_end, rb > 0 ? rb - 1 : 0);
            const int64_t sl = __shfl_sync(0xffffffffu, my_slot, rb);
            const bool mine = r + b < 32 && begin_b >= q0 && end_b <= q1 && end_b - 1 >= qb && end_b - 1 <= qb + 3;
            slot_b[b] = mine ? sl : -1;
            if (slot_b[b] >= 0) load_cols<kOpt>(u, slot_b[b], lane, w[b], s1[b], s2[b]);
        }
        float v[4][kSegCols];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            const int64_t q = qb + rr;
            const int64_t src = __shfl_sync(0xffffffffu, my_src, (int)((q < q1 ? q : q0) - q0));
#pragma unroll
            for (int j = 0; j < kSegCols; ++j) {
                const int64_t c = lane + 32 * j;
                v[rr][j] = q < q1 && c < p.dim ? load_f32(p.grad, p.grad_dtype, src * p.dim + c) : 0.f;
            }
        }
        const int r0 = r;
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            const int64_t q = qb + rr;
            if (q >= q1) break;
            const float sc = __shfl_sync(0xffffffffu, my_scale, (int)(q - q0));
#pragma unroll
            for (int j = 0; j < kSegCols; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(sc, v[rr][j]));
            if (q + 1 == u_end || q + 1 == q1) { /* the run of id lo + r ends here */
                if (u_begin >= q0 && u_end <= q1) {
                    const int b = r - r0;  // < 4: at most four runs end in four occurrences
#pragma unroll
                    for (int bb = 0; bb < 4; ++bb)
                        if (bb == b && slot_b[bb] >= 0) apply_cols<kOpt>(u, slot_b[bb], lane, acc, w[bb], s1[bb], s2[bb]);
                } else {
                    float *dst = p.partial + ((2 * k + (u_begin < q0 ? 0 : 1)) * p.dim);
#pragma unroll
                    for (int j = 0; j < kSegCols; ++j)
                        if (lane + 32 * j < p.dim) dst[lane + 32 * j] = acc[j];
                }
#pragma unroll
                for (int j = 0; j < kSegCols; ++j) acc[j] = 0.f;
                if (q + 1 < q1 && lo + r + 1 < p.n_unique) {
                    ++r;
                    u_begin = u_end;
                    u_end = __shfl_sync(0xffffffffu, my_end, r < 32 ? r : 31);
                }
            }
        }
    }
}

/* segsum_join_kernel's sums of the runs cut by chunk edges, applied to their rows. */
template <int kOpt>
__global__ void segsum_update_join_kernel(tf_dynemb_segsum_params p, tf_dynemb_update_params u) {
    const int64_t k = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t q0 = k * TF_DYNEMB_SEG_CHUNK;
    if (q0 >= p.n_occ) return;
    int64_t k1;
    const int64_t id = seg_cut_run(p, q0, seg_chunk_end(p, q0), lane, &k1);
    if (id < 0 || u.slots[id] < 0) return;
    const int64_t slot = u.slots[id];
    float g[kSegCols], w[kSegCols], s1[kSegCols], s2[kSegCols];
    seg_joined<kSegCols>(p, k, k1, lane, g);
    load_cols<kOpt>(u, slot, lane, w, s1, s2);
    apply_cols<kOpt>(u, slot, lane, g, w, s1, s2);
}

/* Ids with an empty run (not produced by unique ids, but defined): a step with a zero gradient, as
 * segment_sum's zeros then update would take. A thread per id: the check is all most ids need. */
template <int kOpt>
__global__ void segsum_update_empty_kernel(tf_dynemb_segsum_params p, tf_dynemb_update_params u) {
    const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (id >= p.n_unique || p.seg[id + 1] > p.seg[id] || u.slots[id] < 0) return;
    const int64_t slot = u.slots[id];
    char *row = tf_dynemb_row(&u.values, slot);
    float *st = u.state.row_bytes ? reinterpret_cast<float *>(tf_dynemb_row(&u.state, slot)) : nullptr;
    float rw_mult = 0.f;
    if (kOpt == TF_OPT_ROWWISE_ADAGRAD) {
        const float m = st[0] + 0.f / static_cast<float>(u.dim);
        st[0] = m;
        rw_mult = u.lr / (sqrtf(m) + u.eps);
    }
    for (int64_t j = 0; j < u.dim; ++j) {
        float s1 = kOpt == TF_OPT_ADAGRAD || kOpt == TF_OPT_ADAM ? st[j] : 0.f;
        float s2 = kOpt == TF_OPT_ADAM ? st[u.dim + j] : 0.f;
        store_f32(row, u.dtype, j, opt_step(u, kOpt, load_f32(row, u.dtype, j), 0.f, s1, s2, rw_mult));
        if (kOpt == TF_OPT_ADAGRAD || kOpt == TF_OPT_ADAM) st[j] = s1;
        if (kOpt == TF_OPT_ADAM) st[u.dim + j] = s2;
    }
}

}  // namespace

extern "C" {

int tf_dynemb_segsum_cuda(const tf_dynemb_segsum_params *p, void *stream) {
    if (p->n_unique == 0) return 0;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (p->n_occ > 0) {
        segsum_chunk_kernel<<<grid_for_warps(tf_dynemb_seg_chunks(p->n_occ)), kBlock, 0, s>>>(*p);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return static_cast<int>(err);
    }
    if (p->n_occ > 0) {
        seg_levels_launch(*p, s);
        segsum_join_kernel<<<grid_for_warps(tf_dynemb_seg_chunks(p->n_occ)), kBlock, 0, s>>>(*p);
    }
    segsum_empty_kernel<<<grid_for_threads(p->n_unique), kBlock, 0, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
}

int tf_dynemb_tables_update_cuda(const tf_dynemb_update_params *p, const int64_t *start, int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return TF_TABLES_LAUNCH(tf_dynemb_update_params, p, start, n_tables, update_kernel, grid_for_warps, s);
}

int tf_dynemb_update_cuda(const tf_dynemb_update_params *p, void *stream) {
    const int64_t start[2] = {0, p->n};
    return tf_dynemb_tables_update_cuda(p, start, 1, stream);
}

int tf_dynemb_segsum_update_cuda(const tf_dynemb_segsum_params *p, const tf_dynemb_update_params *u, void *stream) {
    if (p->n_unique == 0) return 0;
    if (p->dim > TF_DYNEMB_SEGSUM_UPDATE_MAX_DIM || TF_DYNEMB_SEGSUM_UPDATE_MAX_DIM > 32 * kSegCols)
        return static_cast<int>(cudaErrorInvalidValue);  // the glue takes two ops instead
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned grid = grid_for_warps(tf_dynemb_seg_chunks(p->n_occ));
    // 94-128 registers: blocks of 4 warps pack more warps per SM than blocks of 8
    const unsigned grid128 = static_cast<unsigned>((tf_dynemb_seg_chunks(p->n_occ) + 3) / 4);
#define TF_SEGUPD(OPT)                                                                           \
    if (p->n_occ > 0) {                                                                          \
        segsum_update_kernel<OPT><<<grid128, 128, 0, s>>>(*p, *u);                                \
        seg_levels_launch(*p, s);                                                                \
        segsum_update_join_kernel<OPT><<<grid, kBlock, 0, s>>>(*p, *u);                           \
    }                                                                                            \
    segsum_update_empty_kernel<OPT><<<grid_for_threads(p->n_unique), kBlock, 0, s>>>(*p, *u);
    switch (u->opt) {
    case TF_OPT_SGD: TF_SEGUPD(TF_OPT_SGD) break;
    case TF_OPT_ADAGRAD: TF_SEGUPD(TF_OPT_ADAGRAD) break;
    case TF_OPT_ROWWISE_ADAGRAD: TF_SEGUPD(TF_OPT_ROWWISE_ADAGRAD) break;
    case TF_OPT_ADAM: TF_SEGUPD(TF_OPT_ADAM) break;
    default: return static_cast<int>(cudaErrorInvalidValue);
    }
#undef TF_SEGUPD
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
