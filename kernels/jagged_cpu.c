/* Jagged ops, CPU path: the same per-row mapping as the CUDA kernels (jagged_map.h), a run of
 * consecutive rows at a time. The glue (csrc/jagged.cpp) has already validated offsets and indices and splits the tasks
 * over threads. */
#include <string.h>

#include "jagged_map.h"
#include "tf_dtype.h"

static void fill_row(char *dst, int64_t row_bytes, uint64_t fill, int elem_size) {
    if (fill == 0) {
        memset(dst, 0, (size_t)row_bytes);
        return;
    }
    for (int64_t i = 0; i < row_bytes; i += elem_size) memcpy(dst + i, &fill, (size_t)elem_size);
}

void tfj_copy_cpu(const tfj_copy_params *p, int64_t begin, int64_t end) {
    int64_t hint = -1;
    for (int64_t r = begin; r < end;) {
        const char *src;
        int64_t run;
        char *dst = tfj_resolve(p, r, &src, &hint, &run);
        /* A run is cut at the next multiple of TFJ_RUN_ROWS, where the CUDA kernel's groups start, so
         * these tests resolve runs from the same rows as the GPU does (mid-sample, mid-piece). */
        const int64_t next = (r / TFJ_RUN_ROWS + 1) * TFJ_RUN_ROWS;
        const int64_t n = run < next - r ? run : next - r;
        const int64_t m = n < end - r ? n : end - r;
        if (dst) {
            if (src) memcpy(dst, src, (size_t)(m * p->row_bytes));
            else
                for (int64_t k = 0; k < m; ++k) fill_row(dst + k * p->row_bytes, p->row_bytes, p->fill, p->elem_size);
        }
        r += m;
    }
}

void tfj_arith_cpu(const tfj_arith_params *p, int64_t begin, int64_t end) {
    const int64_t D = p->cols;
    const int es = p->dtype == TFJ_F64 ? 8 : tf_dtype_size(p->dtype);
    int64_t hint = -1;
    for (int64_t r = begin; r < end; ++r) {
        const char *d = tfj_arith_dense_row(p, r, D * es, &hint);
        const char *v = (const char *)p->values + r * D * es;
        char *o = (char *)p->out + r * D * es;
        if (!d) {  /* past the dense length: add keeps values, mul gives 0 */
            if (p->mul) memset(o, 0, (size_t)(D * es));
            else memcpy(o, v, (size_t)(D * es));
            continue;
        }
        if (p->dtype == TFJ_F64) {
            const double *vv = (const double *)v, *dd = (const double *)d;
            double *oo = (double *)o;
            for (int64_t c = 0; c < D; ++c) oo[c] = p->mul ? vv[c] * dd[c] : vv[c] + dd[c];
        } else {
            for (int64_t c = 0; c < D; ++c) {
                const float a = tf_load_f32(v, p->dtype, c), b = tf_load_f32(d, p->dtype, c);
                tf_store_f32(o, p->dtype, c, p->mul ? a * b : a + b);
            }
        }
    }
}
