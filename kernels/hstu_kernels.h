/* HSTU attention (pointwise SiLU attention over jagged sequences): the C ABI of the kernel family.
 *
 * Per sequence b (rows offsets[b] .. offsets[b+1] of q, k, v; length n) and head h:
 *   z = alpha * (Q K^T + bias[b, h or 0, :n, :n])          bias optional
 *   O = (M . SiLU(z)) * inv_scale  @ V                     inv_scale = 1 / scaling_seqlen
 * M is generative-recommenders' `_get_valid_attn_mask` (causal), plus FBGEMM's target groups; it is
 * evaluated from positions by tf_hstu_valid() below, which every path (CPU, CUDA) shares, together with
 * the conservative row / column ranges and the "tile needs no mask" test that let kernels skip work.
 *
 * Backward: with s = sigmoid(z), P = M . SiLU(z) * inv_scale:
 *   dV = P^T dO;  dZ = (dO V^T) . M * inv_scale . s (1 + z (1 - s));
 *   dQ = alpha dZ K;  dK = alpha dZ^T Q;  dbias = alpha dZ (summed over heads when bias has one head).
 *
 * Dropout (training, full form only; dropout_p > 0): P is replaced by P . keep / (1 - dropout_p) in O and in
 * the backward (dV = P'^T dO, dZ gains the same factor), keep drawn by Philox (tf_philox.h) per element
 * from tf_hstu_drop_index(), so every path draws the same mask for the same seed and offset and the
 * backward regenerates it.
 *
 * Cached inference (delta > 0): q holds `delta` query rows per sequence (row b*delta + i is the query
 * at position n - delta + i; rows at negative positions give zeros); k, v are the full sequences, or
 * with kv_lengths the first kv_lengths[b] rows of each offsets[b] .. offsets[b+1] span.
 *
 * Tensors are (rows, heads, dim) with a row stride and a head stride in elements and unit dim stride.
 * Dtypes: TF_F32 / TF_F16 / TF_BF16 on every path, TF_HSTU_F64 on the CPU path; all arithmetic on the
 * CPU is in double. */
#ifndef TF_HSTU_KERNELS_H
#define TF_HSTU_KERNELS_H

#include <stdint.h>

#include "tf_dtype.h"
#include "tf_philox.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { TF_HSTU_F64 = 3 }; /* float64, CPU path only */

/* Which CUDA kernels run (16-bit dtypes on a compute capability 9.0 GPU built for sm_90a; everywhere
 * else mma.sync / the fp32 kernels run whatever this says). AUTO: the sm_90a kernels wherever they are
 * faster (every shape but cached inference at head dims up to 128); SM90: wherever they can run; MMA:
 * never. The glue resolves the user's choice (csrc/hstu_cuda.cpp). */
enum { TF_HSTU_AUTO = 0, TF_HSTU_SM90 = 1, TF_HSTU_MMA = 2 };

typedef struct {
    int64_t B, H, dqk, dv;
    int64_t L;                     /* rows of k and v */
    int dtype;                     /* q, k, v, o, do share it */
    const void *q; int64_t q_sr, q_sh;
    const void *k; int64_t k_sr, k_sh;
    const void *v; int64_t v_sr, v_sh;
    void *o;                       /* contiguous (rows, H, dv) */
    const void *offsets; int offsets_i64;       /* B + 1 entries */
    const void *num_targets; int targets_i64;   /* NULL: none */
    /* cached inference (delta > 0) only, NULL: none. Sequence b's keys are then the first kv_lengths[b] rows
     * from offsets[b] (clamped to [0, offsets[b+1] - offsets[b]]): a cache with room to grow in place */
    const void *kv_lengths; int kv_lengths_i64;
    const void *bias; int bias_dtype;            /* NULL: none; (B, Hb, N, N), last dim unit stride */
    int64_t bias_sb, bias_sh, bias_sr;           /* bias_sh = 0 when Hb == 1 */
    int64_t max_seq_len, delta;                  /* delta > 0: cached inference */
    double alpha, inv_scale;   /* the CUDA kernels use them as float */
    int contextual, max_attn_len, min_full, group;
    int backend;                                 /* CUDA: TF_HSTU_AUTO / SM90 / MMA */
    /* backward only */
    const void *dout; int64_t do_sr, do_sh;      /* dout, dq, dk, dv shaped like o, q, k, v; */
    void *dq, *dk, *dvv;                         /* dq/dk/dv: heads contiguous within a row, rows */
    int64_t dq_sr, dk_sr, dv_sr;                 /* dq_sr, dk_sr, dv_sr elements apart (>= H x dim) */
    float *dq_acc;                               /* CUDA: fp32 (rows, H, dqk) zeroed, or NULL */
    /* CUDA, the two-part sm_90a backward (tf_hstu_bwd_sm90_dz_bytes): scratch for the dZ tiles of dz_seqs
     * sequences at a time; set, dQ is written into dq (q's dtype) and dq_acc is not used */
    void *dz; int64_t dz_seqs;
    int *sched;    /* CUDA: one int of device scratch (the sm_90a kernels' work queue), or NULL */
    void *dbias;   /* NULL: no bias gradient; else zeroed, bias's (contiguous) shape: double on the CPU, fp32 on CUDA */
    /* dropout on P (delta == 0 only): off when dropout_p is 0 */
    double dropout_p;  /* the keep test compares against (float)dropout_p on every path */
    tf_philox_args philox;
    /* CUDA, cached inference with few query rows: fp32 scratch of tf_hstu_decode_ws_floats() floats (no
     * zeroing needed); set, tf_hstu_fwd_cuda runs the split-key decode kernels (hstu_decode.cu) */
    float *decode_ws;
    /* with decode_ws: B x H counters, zero before the launch and zero again once it ends (the kernel's
     * last block per (sequence, head) resets its own), so one zeroing at allocation serves every later
     * launch on the same stream; launches that may overlap need their own */
    unsigned int *decode_cnt;
} tf_hstu_params;

/* ---- the mask, shared by every path ---- */
#if defined(__CUDACC__)
#define TF_HSTU_HD static __host__ __device__ __forceinline__
#else
#define TF_HSTU_HD static inline
#endif

typedef struct {
    int n, c, t, u, m, f, g, max_id;
} tf_hstu_mask;

TF_HSTU_HD tf_hstu_mask tf_hstu_mask_make(int n, int t, int c, int m, int f, int g) {
    tf_hstu_mask k;
    k.n = n; k.c = c; k.t = t; k.u = n - t; k.m = m; k.f = f; k.g = g;
    k.max_id = (c > 0 ? n - c + 1 : n) - t;
    return k;
}

/* generative-recommenders' position number: context tokens 0, history p - c + 1, clamped to max_id. */
TF_HSTU_HD int tf_hstu_id(const tf_hstu_mask *k, int p) {
    int id = k->c > 0 ? (p - k->c + 1 > 0 ? p - k->c + 1 : 0) : p;
    return id < k->max_id ? id : k->max_id;
}

/* Row p (query) may attend column q (key); 0 <= p, q < n. */
TF_HSTU_HD int tf_hstu_valid(const tf_hstu_mask *k, int p, int q) {
    const int ip = tf_hstu_id(k, p), iq = tf_hstu_id(k, q);
    int ok = p == q || ip - iq > 0;
    if (k->m > 0) ok = ok && (ip - iq <= k->m || (k->f > 0 && ip >= k->max_id - k->f));
    if (k->c > 0) ok = ok || (ip == 0 && iq < k->max_id);
    if (k->g > 1 && k->t > 0)
        ok = ok || (p >= k->u && q >= k->u && q < p && (p - k->u) / k->g == (q - k->u) / k->g);
    return ok;
}

/* Smallest column q with id(q) >= x (id is non-decreasing in q), or n when there is none. */
TF_HSTU_HD int tf_hstu_first_id_ge(const tf_hstu_mask *k, int x) {
    if (x > k->max_id) return k->n;
    if (x <= 0) return 0;
    const int q = k->c > 0 ? x + k->c - 1 : x;
    return q < k->n ? q : k->n;
}

/* Row p's valid columns (0 <= p < n) as four half-open spans [lo[i], hi[i]) within [0, n), empty when
 * lo >= hi: exactly the q with tf_hstu_valid(k, p, q). They are the keys numbered below p's number
 * (within the window unless p is exempt), p itself, every non-target key for a context row, and the
 * earlier targets of p's group. Kernels turn them into mask bits with a few shifts instead of
 * evaluating the mask per element. */
TF_HSTU_HD void tf_hstu_row_spans(const tf_hstu_mask *k, int p, int lo[4], int hi[4]) {
    const int ip = tf_hstu_id(k, p);
    const int exempt = k->f > 0 && ip >= k->max_id - k->f;
    lo[0] = k->m > 0 && !exempt ? tf_hstu_first_id_ge(k, ip - k->m) : 0;
    hi[0] = tf_hstu_first_id_ge(k, ip);
    lo[1] = p;
    hi[1] = p + 1;
    lo[2] = 0;
    hi[2] = k->c > 0 && ip == 0 ? tf_hstu_first_id_ge(k, k->max_id) : 0;
    lo[3] = 0;
    hi[3] = 0;
    if (k->g > 1 && k->t > 0 && p >= k->u) {
        lo[3] = k->u + (p - k->u) / k->g * k->g;
        hi[3] = p;
    }
}

/* Column q's valid rows (0 <= q < n) as five half-open spans [lo[i], hi[i]) within [0, n): exactly the p
 * with tf_hstu_valid(k, p, q), the transpose of tf_hstu_row_spans for the backward's key-major tiles.
 * They are q itself, the rows numbered above q (within the window, and from the exempt rows on), the
 * context rows when q is not a target, and the later targets of q's group. */
TF_HSTU_HD void tf_hstu_col_spans(const tf_hstu_mask *k, int q, int lo[5], int hi[5]) {
    const int iq = tf_hstu_id(k, q);
    lo[0] = q;
    hi[0] = q + 1;
    lo[1] = tf_hstu_first_id_ge(k, iq + 1);
    hi[1] = k->m > 0 ? tf_hstu_first_id_ge(k, iq + k->m + 1) : k->n;
    lo[2] = 0;
    hi[2] = 0;
    if (k->m > 0 && k->f > 0) {
        const int e = tf_hstu_first_id_ge(k, k->max_id - k->f);
        lo[2] = lo[1] > e ? lo[1] : e;
        hi[2] = k->n;
    }
    lo[3] = 0;
    hi[3] = 0;
    if (k->c > 0 && iq < k->max_id) {
        lo[3] = tf_hstu_first_id_ge(k, 0);
        hi[3] = tf_hstu_first_id_ge(k, 1);
    }
    lo[4] = 0;
    hi[4] = 0;
    if (k->g > 1 && k->t > 0 && q >= k->u) {
        const int end = k->u + ((q - k->u) / k->g + 1) * k->g;
        lo[4] = q + 1;
        hi[4] = end < k->n ? end : k->n;
    }
}

/* Columns that rows [p0, p1) can attend lie in [*lo, *hi] (conservative; 0 <= p0 < p1 <= n). */
TF_HSTU_HD void tf_hstu_col_range(const tf_hstu_mask *k, int p0, int p1, int *lo, int *hi) {
    *hi = p0 < k->c ? k->n - 1 : (p1 - 1 < k->n - 1 ? p1 - 1 : k->n - 1);
    *lo = 0;
    if (k->m > 0 && p0 >= k->c && !(k->f > 0 && tf_hstu_id(k, p1 - 1) >= k->max_id - k->f)) {
        const int x = tf_hstu_id(k, p0) - k->m;
        if (x > 0) *lo = k->c > 0 ? x + k->c - 1 : x;
    }
}

/* Rows that can attend columns [q0, q1) lie in [0, *ctx_end) or [*lo, *hi] (conservative). */
TF_HSTU_HD void tf_hstu_row_range(const tf_hstu_mask *k, int q0, int q1, int *ctx_end, int *lo, int *hi) {
    *ctx_end = k->c > 0 ? (k->c < k->n ? k->c : k->n) : 0;
    *lo = q0;
    *hi = k->n - 1;
    if (k->m > 0 && k->f == 0) {
        const int x = tf_hstu_id(k, q1 - 1) + k->m;
        if (x < k->max_id) {
            const int p = k->c > 0 ? x + k->c - 1 : x;
            if (p < *hi) *hi = p;
        }
    }
}

/* Every (p, q) with p in [p0, p1), q in [q0, q1) is valid (so a kernel may skip the mask there). Rows
 * at or past n do not count: they are a tile's overhang past the sequence's end, whose results no
 * kernel stores (without this, the one warp group straddling the end of every jagged sequence took
 * the masked path on all its tiles: 1.5x the time of the whole forward on an H100). */
TF_HSTU_HD int tf_hstu_tile_full(const tf_hstu_mask *k, int p0, int p1, int q0, int q1) {
    if (p1 > k->n) p1 = k->n;
    if (p1 > k->u || q1 - 1 > p0 || p0 < k->c || q0 < 0) return 0;
    return k->m == 0 || tf_hstu_id(k, p1 - 1) - tf_hstu_id(k, q0) <= k->m;
}

/* ---- dropout ---- */
/* Philox element index of P's element (query row `row` of q, i.e. offsets[b] + position; head h; key
 * position col < max_seq_len). Rows are max_seq_len rounded up to a multiple of 4 apart, so an even
 * column and the next share one Philox block (the mma.sync forward holds such pairs). */
TF_HSTU_HD uint64_t tf_hstu_drop_index(int64_t row, int64_t h, int64_t H, int64_t max_seq_len, int64_t col) {
    const uint64_t stride = ((uint64_t)max_seq_len + 3u) & ~(uint64_t)3u;
    return ((uint64_t)row * (uint64_t)H + (uint64_t)h) * stride + (uint64_t)col;
}

/* The element's factor: 1 / (1 - p) (scale) when kept, else 0. */
TF_HSTU_HD float tf_hstu_drop_factor(uint64_t seed, uint64_t offset, uint64_t e, float p, float scale) {
    return tf_philox_keep(seed, offset, e, p) ? scale : 0.f;
}

/* The factors of elements e and e + 1, e even (one Philox block). */
TF_HSTU_HD void tf_hstu_drop_pair(uint64_t seed, uint64_t offset, uint64_t e, float p, float scale, float *f0,
                                  float *f1) {
    uint32_t w[4];
    tf_philox4x32_10(seed, offset, e >> 2, w);
    const int i = (int)(e & 2u);
    *f0 = tf_philox_uniform(w[i]) >= p ? scale : 0.f;
    *f1 = tf_philox_uniform(w[i + 1]) >= p ? scale : 0.f;
}

/* Cached inference the split-key decode kernels take (kernels/hstu_decode.cu): one query row per sequence
 * (their form for 8 rows measured 4.4x slower than the tiled kernels on an H100),
 * no attn_bias, no dropout, the automatic kernel choice. Any head dims up to 256, unpadded. */
TF_HSTU_HD int tf_hstu_decode_applies(int64_t delta, int has_bias, double dropout_p, int backend) {
    return delta == 1 && !has_bias && dropout_p <= 0 && backend == TF_HSTU_AUTO;
}

/* ---- CPU (kernels/hstu_cpu.c) ---- */
/* Forward of sequences [b0, b1), all heads. */
void tf_hstu_fwd_cpu(const tf_hstu_params *p, int64_t b0, int64_t b1);
/* Backward of sequences [b0, b1), all heads (dbias rows of those sequences only: no races across b). */
void tf_hstu_bwd_cpu(const tf_hstu_params *p, int64_t b0, int64_t b1);

/* ---- CUDA (kernels/hstu_*.cu); return a cudaError_t as int ---- */
int tf_hstu_fwd_cuda(const tf_hstu_params *p, void *stream);
/* The sm_90a (TMA + wgmma) forward, 16-bit dtypes: -1 when it does not apply (not built for sm_90a,
 * the device is not compute capability 9.0, dtype, strides the copy engine cannot address, backend
 * TF_HSTU_MMA, or under TF_HSTU_AUTO cached inference at head dims up to 128, measured slower there);
 * tf_hstu_fwd_cuda tries it first. */
int tf_hstu_fwd_sm90(const tf_hstu_params *p, void *stream);
/* The decode kernels' scratch in floats, 0 when they do not apply (tf_hstu_decode_applies, or nothing to
 * compute); tf_hstu_fwd_cuda runs them when p->decode_ws is set. */
int64_t tf_hstu_decode_ws_floats(const tf_hstu_params *p);
int tf_hstu_decode_cuda(const tf_hstu_params *p, void *stream);
/* Zeroes rows [0, offsets[0]) and [offsets[B], L) (read on the device, clamped to [0, L]) of n (L, ...)
 * tensors: row_bytes[i] bytes a row, rows row_stride_bytes[i] apart (both multiples of 4, 4-byte
 * aligned): the rows no sequence covers, which the kernels never write. Lets unvalidated calls leave
 * outputs unzeroed (the kernels write every row inside [offsets[0], offsets[B])). n <= 3. */
int tf_hstu_zero_outside(void *const *rows, const int64_t *row_bytes, const int64_t *row_stride_bytes, int n,
                         int64_t L, const void *offsets, int offsets_i64, int64_t B, void *stream);
/* Head-dim copies (kernels/hstu_head_dims.cu): up to TF_HSTU_HEAD_PLANES tensors at once, each
 * out[l, h, c] = c < d_src ? src[l, h, c] : 0 for c < d_dst, in dst_dtype; src (L, H, d_src) and dst
 * (L, H, d_dst) with rows and heads at the given element strides (the last dim unit-stride); dst strides
 * of 0 mean contiguous. */
#define TF_HSTU_HEAD_PLANES 4
typedef struct {
    const void *src;
    void *dst;
    int64_t L, H, src_row_stride, src_head_stride, dst_row_stride, dst_head_stride;
    int d_src, d_dst, src_dtype, dst_dtype;
} tf_hstu_head_plane;
typedef struct {
    tf_hstu_head_plane planes[TF_HSTU_HEAD_PLANES];
    int n;
} tf_hstu_head_copy_params;
int tf_hstu_head_copy_cuda(const tf_hstu_head_copy_params *p, void *stream);
/* Needs p->dq_acc (fp32, zeroed), or p->dz and p->dq (tf_hstu_bwd_sm90_dz_bytes), and, with a bias gradient,
 * p->dbias (fp32, zeroed). */
int tf_hstu_bwd_cuda(const tf_hstu_params *p, void *stream);
/* The sm_90a (TMA + wgmma) backward, 16-bit dtypes, head dims up to 256, no attn_bias: -1 when it does
 * not apply (as tf_hstu_fwd_sm90); tf_hstu_bwd_cuda tries it first. */
int tf_hstu_bwd_sm90(const tf_hstu_params *p, void *stream);
/* Head dims 65-256 on sm_90a: the backward in two parts, dZ's tiles (64 query rows x the backward's key
 * tile) stored by the first and dQ = dZ K by a GEMM of its own (hstu_bwd_dq_sm90.cu), instead of dQ's
 * fp32 reduce-adds. The bytes of dZ scratch it needs, at most cap, for *seqs sequences at a time (the
 * caller then sets dz, dz_seqs and dq, in q's dtype); 0 where it does not apply (the caller sets dq_acc as
 * for tf_hstu_bwd_cuda). */
int64_t tf_hstu_bwd_sm90_dz_bytes(const tf_hstu_params *p, int64_t cap, int64_t *seqs);
/* dQ = dZ K over the stored tiles of p's sequences (p: one chunk of them), into p->dq. */
int tf_hstu_bwd_dq_sm90(const tf_hstu_params *p, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TF_HSTU_KERNELS_H */
