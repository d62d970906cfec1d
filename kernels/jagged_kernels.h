/* Jagged tensor ops: the C ABI of the kernel family.
 *
 * A jagged tensor is `values` (T rows of row_bytes bytes) plus int64 `offsets` (B+1): sample b owns
 * rows offsets[b] .. offsets[b+1]. A "dense" side has no offsets: sample b owns rows b*L .. b*L+L.
 *
 * Every op except jagged_dense_add/mul moves whole rows unchanged, so one copy kernel serves them all:
 * the work is a list of `tasks` rows; for task r, tfj_resolve() (jagged_map.h, shared by the CPU and
 * CUDA paths) names a source row (or "fill with the pad pattern") and a destination row (or "none").
 * Rows are raw bytes, so one compiled kernel serves every dtype of the same row length.
 *
 * Safety: every row index is checked against the row count of the tensor it addresses and every
 * offsets read stays in [0, B], so no offsets, indices or sizes can make a kernel touch memory out of
 * bounds. Rows that bad offsets would place outside a tensor are filled (sources) or dropped
 * (destinations). The CPU glue rejects such inputs before calling (csrc/jagged.cpp). */
#ifndef TF_JAGGED_KERNELS_H
#define TF_JAGGED_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    TFJ_TO_PADDED = 0, /* tasks = B*L dense rows; src = values[off[b] + p] when p < len_b, else fill */
    TFJ_TO_JAGGED = 1, /* tasks = T jagged rows; src = dense[b*L + p] when p < L, else fill */
    TFJ_CONCAT = 2,    /* tasks = output rows; src from part i (per sample: the parts in order) */
    TFJ_SPLIT = 3,     /* tasks = input rows; dst into part i (the inverse of TFJ_CONCAT) */
    TFJ_INDEX = 4,     /* tasks = output rows; src = values[in_off[idx[k]] + p] */
};

#define TFJ_MAX_PARTS 8
/* Rows per group step of the CUDA copy kernel (its fast path copies a whole run of this many rows). */
#define TFJ_RUN_ROWS 8

/* Arithmetic dtypes of jagged_dense_add / mul: tf_dtype.h's codes plus float64. */
enum { TFJ_F64 = 3 };

typedef struct {
    int64_t rows;                    /* row count, for bounds checks */
    const int64_t *offsets;          /* B+1 entries; NULL: dense, sample b owns rows b*dense_len .. +dense_len */
    int64_t dense_len;
    void *data;                      /* row-major, row_bytes per row */
} tfj_part;

typedef struct {
    int mode;
    int64_t tasks;                   /* rows of work (see the modes) */
    int64_t row_bytes;               /* bytes per row: D * element size */
    int64_t n_samples;               /* B */
    const int64_t *offsets;          /* B+1: the searched offsets (TO_PADDED, TO_JAGGED: the jagged side;
                                        CONCAT, SPLIT, INDEX: the combined output offsets) */
    int64_t max_len;                 /* L of the dense side (TO_PADDED, TO_JAGGED) */
    tfj_part src, dst;               /* TO_PADDED/TO_JAGGED/INDEX: both; CONCAT: dst; SPLIT: src */
    int n_parts;                     /* CONCAT/SPLIT: the per-sample pieces, in order */
    tfj_part parts[TFJ_MAX_PARTS];
    int64_t prefix;                  /* CONCAT/SPLIT with 2 parts: the first min(prefix, len_1) rows of
                                        part 1 come before part 0 */
    const int64_t *in_offsets;       /* INDEX: offsets of the source samples (n_in + 1) */
    const int64_t *indices;          /* INDEX: one source sample per output sample */
    int64_t n_in;
    uint64_t fill;                   /* the pad element's bits (elem_size bytes, little-endian) */
    int elem_size;                   /* 1, 2, 4 or 8 */
} tfj_copy_params;

typedef struct {
    int64_t rows;                    /* T */
    int64_t cols;                    /* D (elements per row) */
    int64_t n_samples;               /* B */
    const int64_t *offsets;          /* B+1 */
    int64_t max_len;                 /* L = dense.shape[1] */
    const void *values;              /* T x D */
    const void *dense;               /* B x L x D */
    void *out;                       /* T x D */
    int dtype;                       /* TF_F32 / TF_F16 / TF_BF16 / TFJ_F64 */
    int mul;                         /* 0: out = values + dense (values past L), 1: values * dense (0 past L) */
} tfj_arith_params;

/* ---- CPU (kernels/jagged_cpu.c) ---- */
/* Tasks [begin, end). */
void tfj_copy_cpu(const tfj_copy_params *p, int64_t begin, int64_t end);
void tfj_arith_cpu(const tfj_arith_params *p, int64_t begin, int64_t end);

/* ---- CUDA (kernels/jagged_cuda.cu); return a cudaError_t as int ---- */
int tfj_copy_cuda(const tfj_copy_params *p, void *stream);
int tfj_arith_cuda(const tfj_arith_params *p, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TF_JAGGED_KERNELS_H */
