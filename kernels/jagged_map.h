/* Where each row of a jagged op comes from and goes to: shared by the CPU loop (jagged_cpu.c) and the
 * CUDA kernels (jagged_cuda.cu), so both paths compute the same thing by construction.
 *
 * Every offsets read is at an index in [0, B]; every returned row address lies inside its tensor
 * (tfj_row checks the row against the tensor's row count), whatever the offsets hold. */
#ifndef TF_JAGGED_MAP_H
#define TF_JAGGED_MAP_H

#include "jagged.h"

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

/* Row `pos` of sample b of the concatenation of the parts, as an address in the part that holds it, or
 * NULL when the sample is shorter. With two parts and a prefix P the order is
 * [part1[:P], part0, part1[P:]]. The loops unroll so that parts[] is indexed by constants only. */
TFJ_FN char *tfj_piece(const tfj_copy_params *p, int64_t b, int64_t pos) {
    if (p->n_parts == 2 && p->prefix > 0) {
        const int64_t l0 = tfj_part_len(&p->parts[0], b), l1 = tfj_part_len(&p->parts[1], b);
        const int64_t pre = p->prefix < l1 ? p->prefix : l1;
        if (pos < pre) return tfj_row(&p->parts[1], tfj_part_start(&p->parts[1], b) + pos, p->row_bytes);
        pos -= pre;
        if (pos < l0) return tfj_row(&p->parts[0], tfj_part_start(&p->parts[0], b) + pos, p->row_bytes);
        pos -= l0;
        if (pos < l1 - pre) return tfj_row(&p->parts[1], tfj_part_start(&p->parts[1], b) + pre + pos, p->row_bytes);
        return 0;
    }
#ifdef __CUDACC__
#pragma unroll
#endif
    for (int i = 0; i < TFJ_MAX_PARTS; ++i) {
        if (i >= p->n_parts) break;
        const int64_t l = tfj_part_len(&p->parts[i], b);
        if (pos < l) return tfj_row(&p->parts[i], tfj_part_start(&p->parts[i], b) + pos, p->row_bytes);
        pos -= l;
    }
    return 0;
}

/* Task r: returns the destination row's address (NULL: nothing to write) and sets *src to the source
 * row's address (NULL: write the fill pattern). *hint: as for tfj_find_from (-1 when unknown). */
TFJ_FN char *tfj_resolve(const tfj_copy_params *p, int64_t r, const char **src, int64_t *hint) {
    const int64_t rb = p->row_bytes, n = p->n_samples;
    *src = 0;
    switch (p->mode) {
    case TFJ_TO_PADDED: {
        const int64_t L = p->max_len;
        const int64_t b = r / L, pos = r - b * L;
        if (b < n && pos < tfj_max0(p->offsets[b + 1] - p->offsets[b]))
            *src = tfj_row(&p->src, p->offsets[b] + pos, rb);
        return tfj_row(&p->dst, r, rb);
    }
    case TFJ_TO_JAGGED: {
        if (n > 0) {
            const int64_t b = tfj_find_from(p->offsets, n, r, hint), pos = r - p->offsets[b];
            if (pos >= 0 && pos < p->offsets[b + 1] - p->offsets[b] && pos < p->max_len)
                *src = tfj_row(&p->src, b * p->max_len + pos, rb);
        }
        return tfj_row(&p->dst, r, rb);
    }
    case TFJ_CONCAT:
    case TFJ_SPLIT: {
        char *piece = 0;
        if (n > 0) {
            const int64_t b = tfj_find_from(p->offsets, n, r, hint), pos = r - p->offsets[b];
            if (pos >= 0 && pos < p->offsets[b + 1] - p->offsets[b]) piece = tfj_piece(p, b, pos);
        }
        if (p->mode == TFJ_CONCAT) {
            *src = piece;
            return tfj_row(&p->dst, r, rb);
        }
        *src = tfj_row(&p->src, r, rb);
        return *src ? piece : 0;
    }
    case TFJ_INDEX: {
        if (n > 0) {
            const int64_t k = tfj_find_from(p->offsets, n, r, hint), pos = r - p->offsets[k];
            const int64_t j = p->indices[k];
            if (pos >= 0 && pos < p->offsets[k + 1] - p->offsets[k] && j >= 0 && j < p->n_in &&
                pos < p->in_offsets[j + 1] - p->in_offsets[j])
                *src = tfj_row(&p->src, p->in_offsets[j] + pos, rb);
        }
        return tfj_row(&p->dst, r, rb);
    }
    }
    return 0;
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
