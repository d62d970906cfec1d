// Argument checks and tensor-to-kernel conversions shared by every op's glue.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../kernels/tf_dtype.h"

namespace torchfuse {

// The kernels' dtype code of a float tensor; a clear error for any other dtype.
inline int kernel_dtype(at::ScalarType t, const char *op, const char *arg) {
    switch (t) {
    case at::kFloat: return TF_F32;
    case at::kHalf: return TF_F16;
    case at::kBFloat16: return TF_BF16;
    default:
        TORCH_CHECK_TYPE(false, op, ": ", arg, " must be float32, float16 or bfloat16, got ", t);
    }
    return -1;
}

inline void check_same_device(const at::Tensor &t, const at::Tensor &ref, const char *op, const char *arg,
                              const char *ref_arg) {
    TORCH_CHECK(t.device() == ref.device(), op, ": ", arg, " must be on the same device as ", ref_arg, " (",
                ref.device(), "), got ", t.device());
}

// A matrix view of `t` as (rows, cols) with unit column stride: the row stride in elements, and the
// tensor to read (t itself, or a contiguous copy when its layout does not collapse to rows).
struct RowMatrix {
    at::Tensor t;
    int64_t row_stride;
};

inline RowMatrix as_rows(const at::Tensor &t) {
    const int64_t nd = t.dim();
    const int64_t cols = nd == 0 ? 1 : t.size(-1);
    if (nd >= 1 && (t.stride(-1) == 1 || cols == 1)) {
        // Leading dims must collapse to one row index: each non-unit dim's stride equals the next
        // non-unit dim's stride times its size.
        int64_t row_stride = -1, expect = -1;
        bool ok = true;
        for (int64_t d = nd - 2; d >= 0 && ok; --d) {
            if (t.size(d) == 1) continue;
            if (row_stride < 0) row_stride = t.stride(d);
            else ok = t.stride(d) == expect;
            expect = t.stride(d) * t.size(d);
        }
        if (ok) return {t, row_stride < 0 ? cols : row_stride};
    }
    return {t.contiguous(), cols};
}

inline int64_t rows_of(const at::Tensor &t) {
    const int64_t cols = t.size(-1);
    return cols == 0 ? 0 : t.numel() / cols;
}

// An empty float tensor standing for an output that was not asked for.
inline at::Tensor no_output(const at::Tensor &like) { return at::empty({0}, like.options().dtype(at::kFloat)); }

}  // namespace torchfuse
