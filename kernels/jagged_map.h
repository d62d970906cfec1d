/* Where each row of a jagged op comes from and goes to: shared by the CPU loop (jagged_cpu.c) and the
 * CUDA kernels (jagged_cuda.cu), so both paths compute the same thing by construction.
 *
 * Every offsets read is at an index in [0, B]; every returned row address lies inside its tensor
 * (tfj_row checks the row against the tensor's row count), whatever the offsets hold. */
#ifndef TF_JAGGED_MAP_H
#define TF_JAGGED_MAP_H

#include "jagged_kernels.h"

#ifdef __CUDACC__
#define TFJ_FN static __host__ __device__ __forceinline__
#else
#define TFJ_FN static inline
#endif

TFJ_FN int64_t tfj_max0(int64_t v) { return v < 0 ? 0 : v; }

/* First row and length of sample b of a part (b in [0, B)). */
TFJ_FN int64_t tfj_part_start(const tfj_part *q, int64_t b) { return q->offsets ? q->offsets[b] : b * q->dense_len; }
TFJ_FN int64_t tfj_part_len(const tfj_part *q, int64_t b) {
    return q->offsets ? tfj_max0(q->offsets[b + 1] - q->offsets[b]) : q->dense_len;
}

/* Address of row `row` of a part, or NULL when the row is outside the tensor. */
TFJ_FN char *tfj_row(const tfj_part *q, int64_t row, int64_t row_bytes) {
    if (row < 0 || row >= q->rows) return 0;
    return (char *)q->data + row * row_bytes;
}

/* The sample holding row r: the last b in [0, n) with off[b] <= r (0 when none). n >= 1. For monotone
 * offsets this is the b with off[b] <= r < off[b+1]; for any offsets it is some b in [0, n). */
TFJ_FN int64_t tfj_find(const int64_t *off, int64_t n, int64_t r) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) >> 1;
        if (off[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* tfj_find with a hint: *hint is the sample of a nearby earlier row (or -1). Consecutive rows mostly
 * share a sample, so a few forward steps usually replace the binary search. Same result as tfj_find
 * for monotone offsets; for any offsets some b in [0, n). Updates *hint. */
TFJ_FN int64_t tfj_find_from(const int64_t *off, int64_t n, int64_t r, int64_t *hint) {
    int64_t lo = 0, b = *hint;
    if (b >= 0 && b < n && off[b] <= r) {
        for (int s = 0; s < 4 && b + 1 < n && off[b + 1] <= r; ++s) ++b;
        if (b + 1 >= n || off[b + 1] > r) {
            *hint = b;
            return b;
        }
        lo = b;
    }
    int64_t hi = n - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) >> 1;
        if (off[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    *hint = lo;
    return lo;
}

/* Rows of q from `row` on while they stay inside q (row itself inside: tfj_row returned non-NULL). */
TFJ_FN int64_t tfj_rows_left(const tfj_part *q, int64_t row) { return q->rows - row; }

TFJ_FN int64_t tfj_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* Row `pos` of sample b of the concatenation of the parts, as an address in the part that holds it, or
 * NULL when the sample is shorter. With two parts and a prefix P the order is
 * [part1[:P], part0, part1[P:]]. *left: how many rows from this one on stay in the same piece and
 * inside its tensor (1 when NULL is returned). The loops unroll so that parts[] is indexed by
 * constants only. */
TFJ_FN char *tfj_piece_at(const tfj_part *q, int64_t start, int64_t i, int64_t len, int64_t rb, int64_t *left) {
    char *a = tfj_row(q, start + i, rb);
    *left = a ? tfj_min(len - i, tfj_rows_left(q, start + i)) : 1;
    return a;
}

TFJ_FN char *tfj_piece(const tfj_copy_params *p, int64_t b, int64_t pos, int64_t *left) {
    *left = 1;
    if (p->n_parts == 2 && p->prefix > 0) {
        const int64_t l0 = tfj_part_len(&p->parts[0], b), l1 = tfj_part_len(&p->parts[1], b);
        const int64_t pre = p->prefix < l1 ? p->prefix : l1;
        if (pos < pre) return tfj_piece_at(&p->parts[1], tfj_part_start(&p->parts[1], b), pos, pre, p->row_bytes, left);
        pos -= pre;
        if (pos < l0) return tfj_piece_at(&p->parts[0], tfj_part_start(&p->parts[0], b), pos, l0, p->row_bytes, left);
        pos -= l0;
        if (pos < l1 - pre)
            return tfj_piece_at(&p->parts[1], tfj_part_start(&p->parts[1], b) + pre, pos, l1 - pre, p->row_bytes, left);
        return 0;
    }
#ifdef __CUDACC__
#pragma unroll
#endif
    for (int i = 0; i < TFJ_MAX_PARTS; ++i) {
        if (i >= p->n_parts) break;
        const int64_t l = tfj_part_len(&p->parts[i], b);
        if (pos < l) return tfj_piece_at(&p->parts[i], tfj_part_start(&p->parts[i], b), pos, l, p->row_bytes, left);
        pos -= l;
    }
    return 0;
}

/* Task r: returns the destination row's address (NULL: nothing to write) and sets *src to the source
 * row's address (NULL: write the fill pattern). *hint: as for tfj_find_from (-1 when unknown).
 * *run (>= 1): how many tasks r, r+1, ... map to consecutive rows of the same tensors, task r+k to
 * dst + k*row_bytes and src + k*row_bytes (or the fill pattern when *src is NULL), every one of them
 * inside its tensor: the CUDA kernel copies such a run as one block, the CPU loop with one memcpy.
 * For valid offsets that is what tfj_resolve gives for each of those tasks; for any offsets no row of
 * a run leaves its tensor. Cases that only bad offsets reach give a run of 1. */
TFJ_FN char *tfj_resolve(const tfj_copy_params *p, int64_t r, const char **src, int64_t *hint, int64_t *run) {
    const int64_t rb = p->row_bytes, n = p->n_samples;
    char *dst = 0;
    int64_t k = 1; /* the run before the destination's bounds */
    *src = 0;
    switch (p->mode) {
    case TFJ_TO_PADDED: {
        const int64_t L = p->max_len;
        const int64_t b = r / L, pos = r - b * L;
        k = L - pos; /* fill to the end of the sample's dense rows */
        if (b < n) {
            const int64_t len = tfj_max0(p->offsets[b + 1] - p->offsets[b]);
            if (pos < len) {
                *src = tfj_row(&p->src, p->offsets[b] + pos, rb);
                k = *src ? tfj_min(tfj_min(len, L) - pos, tfj_rows_left(&p->src, p->offsets[b] + pos)) : 1;
            }
        }
        dst = tfj_row(&p->dst, r, rb);
        break;
    }
    case TFJ_TO_JAGGED: {
        if (n > 0) {
            const int64_t b = tfj_find_from(p->offsets, n, r, hint), pos = r - p->offsets[b];
            const int64_t len = p->offsets[b + 1] - p->offsets[b];
            if (pos >= 0 && pos < len && pos < p->max_len) {
                *src = tfj_row(&p->src, b * p->max_len + pos, rb);
                if (*src) k = tfj_min(tfj_min(len, p->max_len) - pos, tfj_rows_left(&p->src, b * p->max_len + pos));
            } else if (pos >= p->max_len && pos < len) {
                k = len - pos; /* rows past the dense length: fill */
            }
        }
        dst = tfj_row(&p->dst, r, rb);
        break;
    }
    case TFJ_CONCAT:
    case TFJ_SPLIT: {
        char *piece = 0;
        int64_t left = 1;
        if (n > 0) {
            const int64_t b = tfj_find_from(p->offsets, n, r, hint), pos = r - p->offsets[b];
            const int64_t len = p->offsets[b + 1] - p->offsets[b];
            if (pos >= 0 && pos < len) {
                piece = tfj_piece(p, b, pos, &left);
                left = tfj_min(left, len - pos);
            }
        }
        if (p->mode == TFJ_CONCAT) {
            *src = piece;
            k = piece ? left : 1;
            dst = tfj_row(&p->dst, r, rb);
        } else {
            *src = tfj_row(&p->src, r, rb);
            dst = *src ? piece : 0;
            k = dst ? tfj_min(left, tfj_rows_left(&p->src, r)) : 1;
        }
        break;
    }
    case TFJ_INDEX: {
        if (n > 0) {
            const int64_t kk = tfj_find_from(p->offsets, n, r, hint), pos = r - p->offsets[kk];
            const int64_t j = p->indices[kk];
            const int64_t len = p->offsets[kk + 1] - p->offsets[kk];
            if (pos >= 0 && pos < len && j >= 0 && j < p->n_in) {
                const int64_t in_len = p->in_offsets[j + 1] - p->in_offsets[j];
                if (pos < in_len) {
                    *src = tfj_row(&p->src, p->in_offsets[j] + pos, rb);
                    if (*src) k = tfj_min(tfj_min(len, in_len) - pos, tfj_rows_left(&p->src, p->in_offsets[j] + pos));
                }
            }
        }
        dst = tfj_row(&p->dst, r, rb);
        break;
    }
    }
    if (p->mode == TFJ_SPLIT) {
        /* the destination is a piece: its bounds are already in k */
    } else if (dst) {
        k = tfj_min(k, tfj_rows_left(&p->dst, r));
    }
    k = tfj_min(k, p->tasks - r);
    *run = dst && k > 1 ? k : 1;
    return dst;
}

/* jagged_dense_add/mul, row r: the dense row to combine with (NULL: past the dense length or outside
 * every sample). */
TFJ_FN const char *tfj_arith_dense_row(const tfj_arith_params *p, int64_t r, int64_t row_bytes, int64_t *hint) {
    if (p->n_samples <= 0 || p->max_len <= 0) return 0;
    const int64_t b = tfj_find_from(p->offsets, p->n_samples, r, hint), pos = r - p->offsets[b];
    if (pos < 0 || pos >= p->offsets[b + 1] - p->offsets[b] || pos >= p->max_len) return 0;
    return (const char *)p->dense + (b * p->max_len + pos) * row_bytes;
}

#endif /* TF_JAGGED_MAP_H */
