// Jagged tensor ops: argument checks, output allocation and kernel parameters for every device (the
// backend runs the kernels), and the CPU backend. Semantics: python/torchfuse/jagged.py.
#include "jagged.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <string>

#include "tf_check.h"
#include "../kernels/tf_dtype.h"

namespace torchfuse {
namespace jagged {
namespace {

// Values: any float dtype, or int32 / int64 (the copy ops move raw rows).
void check_values(const at::Tensor &v, const char *op, const char *arg, bool float_only = false) {
    const auto t = v.scalar_type();
    const bool is_float = t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
    if (float_only) {
        TORCH_CHECK_TYPE(is_float, op, ": ", arg, " must be float32, float16, bfloat16 or float64, got ", t);
    } else {
        TORCH_CHECK_TYPE(is_float || t == at::kInt || t == at::kLong, op, ": ", arg,
                         " must be a float dtype, int32 or int64, got ", t);
    }
}

// Elements per row of a (rows, *D) tensor.
int64_t row_elems(const at::Tensor &v, int64_t lead_dims) {
    int64_t d = 1;
    for (int64_t i = lead_dims; i < v.dim(); ++i) d *= v.size(i);
    return d;
}

// Offsets as a contiguous int64 tensor; a 1-D int32/int64 tensor of at least one entry on values' device.
at::Tensor offsets64(const at::Tensor &off, const at::Tensor &like, const char *op, const char *arg) {
    TORCH_CHECK(off.dim() == 1 && off.size(0) >= 1, op, ": ", arg,
                " must be 1-D with B+1 >= 1 entries, got shape ", off.sizes());
    TORCH_CHECK_TYPE(off.scalar_type() == at::kInt || off.scalar_type() == at::kLong, op, ": ", arg,
                     " must be int32 or int64, got ", off.scalar_type());
    check_same_device(off, like, op, arg, "values");
    return off.to(at::kLong).contiguous();
}

// Host-side validation (CPU path): starts at 0, never decreases, ends at or before `rows`.
// With `exact`, it must end at `rows` (ops whose every row belongs to a sample: concat and split).
void check_offsets_host(const at::Tensor &off64, int64_t rows, const char *op, const char *arg, const char *rows_what,
                        bool exact = false) {
    const int64_t *o = off64.data_ptr<int64_t>();
    const int64_t n = off64.size(0);
    TORCH_CHECK(o[0] == 0, op, ": ", arg, "[0] must be 0, got ", o[0]);
    for (int64_t i = 1; i < n; ++i)
        TORCH_CHECK(o[i] >= o[i - 1], op, ": ", arg, " must be non-decreasing, but ", arg, "[", i, "] = ", o[i],
                    " < ", arg, "[", i - 1, "] = ", o[i - 1]);
    TORCH_CHECK(o[n - 1] <= rows, op, ": ", arg, "[-1] = ", o[n - 1], " is past the end of ", rows_what, " (", rows,
                " rows)");
    TORCH_CHECK(!exact || o[n - 1] == rows, op, ": ", arg, "[-1] = ", o[n - 1], " must equal the row count of ",
                rows_what, " (", rows, "): every row must belong to a sample");
}

int64_t last_entry(const at::Tensor &off64) { return off64.select(0, -1).item<int64_t>(); }  // a host sync

// The bits of `value` as an element of dtype t (the pad pattern of the copy kernel).
uint64_t fill_bits(double value, at::ScalarType t) {
    const at::Tensor s = at::scalar_tensor(value, at::TensorOptions().dtype(t));
    uint64_t bits = 0;
    std::memcpy(&bits, s.data_ptr(), s.element_size());
    return bits;
}

tfj_part part_of(const at::Tensor &t, const at::Tensor *off64, int64_t dense_len) {
    tfj_part q{};
    q.rows = t.dim() == 0 ? 0 : t.size(0);
    q.offsets = off64 ? off64->data_ptr<int64_t>() : nullptr;
    q.dense_len = dense_len;
    q.data = t.data_ptr();
    return q;
}

tfj_copy_params copy_params(int mode, int64_t tasks, const at::Tensor &like, int64_t d) {
    tfj_copy_params p{};
    p.mode = mode;
    p.tasks = tasks;
    p.elem_size = (int)like.element_size();
    p.row_bytes = d * p.elem_size;
    return p;
}

void run_copy(const JaggedBackend &be, const tfj_copy_params &p) {
    if (p.tasks > 0 && p.row_bytes > 0) be.copy(p);
}

// Shape (rows, *tail) where tail = t.sizes()[skip:].
std::vector<int64_t> with_rows(int64_t rows, const at::Tensor &t, int64_t skip) {
    std::vector<int64_t> s{rows};
    for (int64_t i = skip; i < t.dim(); ++i) s.push_back(t.size(i));
    return s;
}

void check_rows_2d(const at::Tensor &v, const char *op, const char *arg) {
    TORCH_CHECK(v.dim() >= 1, op, ": ", arg, " must have a row dimension (T, *D), got a 0-d tensor");
}

}  // namespace

at::Tensor complete_cumsum(const JaggedBackend &be, const at::Tensor &lengths) {
    const char *op = "torchfuse.complete_cumsum";
    TORCH_CHECK(lengths.dim() == 1, op, ": lengths must be 1-D, got shape ", lengths.sizes());
    TORCH_CHECK_TYPE(lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong, op,
                     ": lengths must be int32 or int64, got ", lengths.scalar_type());
    if (be.host_checks && lengths.numel() > 0) {
        const int64_t lo = lengths.min().item<int64_t>();
        TORCH_CHECK(lo >= 0, op, ": lengths must be >= 0, got ", lo);
    }
    at::Tensor out = at::zeros({lengths.size(0) + 1}, lengths.options());
    if (lengths.numel() > 0) out.narrow(0, 1, lengths.size(0)).copy_(at::cumsum(lengths, 0, lengths.scalar_type()));
    return out;
}

at::Tensor to_padded_dense(const JaggedBackend &be, const at::Tensor &values_in, const at::Tensor &offsets,
                           int64_t max_length, double padding_value) {
    const char *op = "torchfuse.jagged_to_padded_dense";
    check_rows_2d(values_in, op, "values");
    check_values(values_in, op, "values");
    TORCH_CHECK(max_length >= 0, op, ": max_length must be >= 0, got ", max_length);
    const at::Tensor off = offsets64(offsets, values_in, op, "offsets");
    const at::Tensor values = values_in.contiguous();
    if (be.host_checks) check_offsets_host(off, values.size(0), op, "offsets", "values");
    const int64_t B = off.size(0) - 1, d = row_elems(values, 1);
    std::vector<int64_t> shape{B, max_length};
    for (int64_t i = 1; i < values.dim(); ++i) shape.push_back(values.size(i));
    at::Tensor out = at::empty(shape, values.options());
    tfj_copy_params p = copy_params(TFJ_TO_PADDED, B * max_length, values, d);
    p.n_samples = B;
    p.offsets = off.data_ptr<int64_t>();
    p.max_len = max_length;
    p.src = part_of(values, nullptr, 0);
    p.dst = part_of(out, nullptr, 0);
    p.dst.rows = B * max_length;  // (B, L) rows
    p.fill = fill_bits(padding_value, values.scalar_type());
    run_copy(be, p);
    return out;
}

at::Tensor dense_to_jagged(const JaggedBackend &be, const at::Tensor &dense_in, const at::Tensor &offsets,
                           std::optional<int64_t> total_length) {
    const char *op = "torchfuse.dense_to_jagged";
    TORCH_CHECK(dense_in.dim() >= 2, op, ": dense must be (B, L, *D), got shape ", dense_in.sizes());
    check_values(dense_in, op, "dense");
    const at::Tensor off = offsets64(offsets, dense_in, op, "offsets");
    const int64_t B = off.size(0) - 1, L = dense_in.size(1);
    TORCH_CHECK(dense_in.size(0) == B, op, ": dense.shape[0] = ", dense_in.size(0),
                " must equal the number of samples len(offsets) - 1 = ", B);
    const at::Tensor dense = dense_in.contiguous();
    int64_t T;
    if (total_length.has_value()) {
        T = *total_length;
        TORCH_CHECK(T >= 0, op, ": total_length must be >= 0, got ", T);
    } else {
        T = last_entry(off);
        TORCH_CHECK(T >= 0, op, ": offsets[-1] must be >= 0, got ", T);
    }
    if (be.host_checks) check_offsets_host(off, T, op, "offsets", "the output (total_length)");
    const int64_t d = row_elems(dense, 2);
    at::Tensor out = at::empty(with_rows(T, dense, 2), dense.options());
    tfj_copy_params p = copy_params(TFJ_TO_JAGGED, T, dense, d);
    p.n_samples = B;
    p.offsets = off.data_ptr<int64_t>();
    p.max_len = L;
    p.src = part_of(dense, nullptr, 0);
    p.src.rows = B * L;
    p.dst = part_of(out, nullptr, 0);
    run_copy(be, p);
    return out;
}

at::Tensor dense_arith(const JaggedBackend &be, const at::Tensor &values_in, const at::Tensor &offsets,
                       const at::Tensor &dense_in, bool mul) {
    const char *op = mul ? "torchfuse.jagged_dense_mul" : "torchfuse.jagged_dense_add";
    check_rows_2d(values_in, op, "values");
    check_values(values_in, op, "values", /*float_only=*/true);
    check_same_device(dense_in, values_in, op, "dense", "values");
    TORCH_CHECK_TYPE(dense_in.scalar_type() == values_in.scalar_type(), op, ": dense must have values' dtype ",
                     values_in.scalar_type(), ", got ", dense_in.scalar_type());
    TORCH_CHECK(dense_in.dim() == values_in.dim() + 1, op, ": dense must be (B, L, *D) for values (T, *D) of shape ",
                values_in.sizes(), ", got ", dense_in.sizes());
    for (int64_t i = 1; i < values_in.dim(); ++i)
        TORCH_CHECK(dense_in.size(i + 1) == values_in.size(i), op, ": dense.shape[2:] must equal values.shape[1:] ",
                    values_in.sizes().slice(1), ", got ", dense_in.sizes().slice(2));
    const at::Tensor off = offsets64(offsets, values_in, op, "offsets");
    const int64_t B = off.size(0) - 1;
    TORCH_CHECK(dense_in.size(0) == B, op, ": dense.shape[0] = ", dense_in.size(0),
                " must equal the number of samples len(offsets) - 1 = ", B);
    const at::Tensor values = values_in.contiguous(), dense = dense_in.contiguous();
    if (be.host_checks) check_offsets_host(off, values.size(0), op, "offsets", "values");
    at::Tensor out = at::empty(values.sizes(), values.options());
    tfj_arith_params p{};
    p.rows = values.size(0);
    p.cols = row_elems(values, 1);
    p.n_samples = B;
    p.offsets = off.data_ptr<int64_t>();
    p.max_len = dense.size(1);
    p.values = values.data_ptr();
    p.dense = dense.data_ptr();
    p.out = out.data_ptr();
    p.dtype = values.scalar_type() == at::kDouble ? TFJ_F64 : kernel_dtype(values.scalar_type(), op, "values");
    p.mul = mul;
    if (p.rows > 0 && p.cols > 0) be.arith(p);
    return out;
}

namespace {

// One side of concat_2d / split_2d: its int64 offsets (undefined: dense) and dense length.
struct Side {
    at::Tensor off;  // int64, or undefined for a dense side
    int64_t dense_len = 0;
    int64_t batch = -1;  // B when known from the offsets
};

Side side_of(const std::optional<at::Tensor> &offsets, std::optional<int64_t> max_len, const at::Tensor &like,
             const char *op, const char *off_arg, const char *len_arg) {
    Side s;
    if (offsets.has_value()) {
        s.off = offsets64(*offsets, like, op, off_arg);
        s.batch = s.off.size(0) - 1;
    } else {
        TORCH_CHECK(max_len.has_value() && *max_len >= 0, op, ": ", len_arg, " (>= 0) is needed when ", off_arg,
                    " is None (a dense side)");
        s.dense_len = *max_len;
    }
    return s;
}

// Combined offsets (int64) of two sides for B samples: off_left + off_right, a dense side b*L.
at::Tensor combined_offsets(const Side &l, const Side &r, int64_t B, const at::Tensor &like) {
    auto side = [&](const Side &s) {
        return s.off.defined() ? s.off : at::arange(B + 1, like.options().dtype(at::kLong)) * s.dense_len;
    };
    return (side(l) + side(r)).contiguous();
}

at::ScalarType out_offsets_dtype(const std::optional<at::Tensor> &a, const std::optional<at::Tensor> &b) {
    if (a.has_value()) return a->scalar_type();
    if (b.has_value()) return b->scalar_type();
    return at::kLong;
}

void check_pair(const at::Tensor &a, const at::Tensor &b, const char *op, const char *an, const char *bn) {
    check_same_device(b, a, op, bn, an);
    TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), op, ": ", an, " and ", bn, " must share a dtype, got ",
                     a.scalar_type(), " and ", b.scalar_type());
    TORCH_CHECK(a.dim() == b.dim() && a.sizes().slice(1) == b.sizes().slice(1), op, ": ", an, " and ", bn,
                " must have the same row shape, got ", a.sizes(), " and ", b.sizes());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> concat_2d(const JaggedBackend &be, const at::Tensor &values_left_in,
                                             const std::optional<at::Tensor> &offsets_left,
                                             const at::Tensor &values_right_in,
                                             const std::optional<at::Tensor> &offsets_right,
                                             std::optional<int64_t> max_len_left, std::optional<int64_t> max_len_right,
                                             int64_t n_prefix_from_right) {
    const char *op = "torchfuse.concat_2d_jagged";
    check_rows_2d(values_left_in, op, "values_left");
    check_values(values_left_in, op, "values_left");
    check_pair(values_left_in, values_right_in, op, "values_left", "values_right");
    TORCH_CHECK(n_prefix_from_right >= 0, op, ": n_prefix_from_right must be >= 0, got ", n_prefix_from_right);
    const at::Tensor vl = values_left_in.contiguous(), vr = values_right_in.contiguous();
    const Side l = side_of(offsets_left, max_len_left, vl, op, "offsets_left", "max_len_left");
    const Side r = side_of(offsets_right, max_len_right, vl, op, "offsets_right", "max_len_right");
    int64_t B;
    if (l.batch >= 0) {
        B = l.batch;
        TORCH_CHECK(r.batch < 0 || r.batch == B, op, ": offsets_left and offsets_right must have the same length, got ",
                    B + 1, " and ", r.batch + 1);
    } else if (r.batch >= 0) {
        B = r.batch;
    } else {
        TORCH_CHECK(l.dense_len > 0 || r.dense_len > 0, op,
                    ": with both sides dense, max_len_left or max_len_right must be > 0");
        B = l.dense_len > 0 ? vl.size(0) / l.dense_len : vr.size(0) / r.dense_len;
    }
    if (!l.off.defined())
        TORCH_CHECK(vl.size(0) == B * l.dense_len, op, ": dense values_left must have B * max_len_left = ", B, " * ",
                    l.dense_len, " rows, got ", vl.size(0));
    if (!r.off.defined())
        TORCH_CHECK(vr.size(0) == B * r.dense_len, op, ": dense values_right must have B * max_len_right = ", B,
                    " * ", r.dense_len, " rows, got ", vr.size(0));
    if (be.host_checks) {
        if (l.off.defined()) check_offsets_host(l.off, vl.size(0), op, "offsets_left", "values_left", true);
        if (r.off.defined()) check_offsets_host(r.off, vr.size(0), op, "offsets_right", "values_right", true);
    }
    const at::Tensor out_off = combined_offsets(l, r, B, vl);
    const int64_t T = vl.size(0) + vr.size(0);
    at::Tensor out = at::empty(with_rows(T, vl, 1), vl.options());
    tfj_copy_params p = copy_params(TFJ_CONCAT, T, vl, row_elems(vl, 1));
    p.n_samples = B;
    p.offsets = out_off.data_ptr<int64_t>();
    p.dst = part_of(out, nullptr, 0);
    p.n_parts = 2;
    p.parts[0] = part_of(vl, l.off.defined() ? &l.off : nullptr, l.dense_len);
    p.parts[1] = part_of(vr, r.off.defined() ? &r.off : nullptr, r.dense_len);
    p.prefix = n_prefix_from_right;
    run_copy(be, p);
    return {out, out_off.to(out_offsets_dtype(offsets_left, offsets_right))};
}

std::tuple<at::Tensor, at::Tensor> split_2d(const JaggedBackend &be, const at::Tensor &values_in,
                                            const std::optional<at::Tensor> &offsets_left,
                                            const std::optional<at::Tensor> &offsets_right,
                                            std::optional<int64_t> max_len_left, std::optional<int64_t> max_len_right,
                                            int64_t n_prefix_to_right, std::optional<int64_t> total_len_left,
                                            std::optional<int64_t> total_len_right) {
    const char *op = "torchfuse.split_2d_jagged";
    check_rows_2d(values_in, op, "values");
    check_values(values_in, op, "values");
    TORCH_CHECK(n_prefix_to_right >= 0, op, ": n_prefix_to_right must be >= 0, got ", n_prefix_to_right);
    const at::Tensor v = values_in.contiguous();
    const Side l = side_of(offsets_left, max_len_left, v, op, "offsets_left", "max_len_left");
    const Side r = side_of(offsets_right, max_len_right, v, op, "offsets_right", "max_len_right");
    TORCH_CHECK(l.batch < 0 || r.batch < 0 || l.batch == r.batch, op,
                ": offsets_left and offsets_right must have the same length, got ", l.batch + 1, " and ", r.batch + 1);
    const int64_t T = v.size(0);
    int64_t B = l.batch >= 0 ? l.batch : r.batch;
    if (B < 0) {
        // Both sides dense (the backward of a both-dense concat): every sample has max_len_left +
        // max_len_right rows, so B follows from T. With both lengths 0 there are no rows to place.
        const int64_t per = l.dense_len + r.dense_len;
        TORCH_CHECK(per > 0 ? T % per == 0 : T == 0, op, ": with both sides dense, values must have B * (max_len_left",
                    " + max_len_right) = B * ", per, " rows, got ", T);
        B = per > 0 ? T / per : 0;
    }
    // Row counts of the two outputs: a dense side has B * max_len; given totals are trusted (no sync);
    // otherwise the left total is read from offsets_left[-1] (a host sync) and the right one follows.
    int64_t tl, tr;
    if (!l.off.defined()) {
        tl = B * l.dense_len;
        tr = total_len_right.value_or(T - tl);
    } else if (!r.off.defined()) {
        tr = B * r.dense_len;
        tl = total_len_left.value_or(T - tr);
    } else if (total_len_left.has_value()) {
        tl = *total_len_left;
        tr = total_len_right.value_or(T - tl);
    } else if (total_len_right.has_value()) {
        tr = *total_len_right;
        tl = T - tr;
    } else {
        tl = last_entry(l.off);
        tr = T - tl;
    }
    TORCH_CHECK(tl >= 0 && tr >= 0 && tl + tr == T, op, ": the two outputs' row counts ", tl, " + ", tr,
                " must be >= 0 and add up to values.shape[0] = ", T);
    if (be.host_checks) {
        if (l.off.defined()) check_offsets_host(l.off, tl, op, "offsets_left", "the left output (total_len_left)", true);
        if (r.off.defined()) check_offsets_host(r.off, tr, op, "offsets_right", "the right output (total_len_right)", true);
    }
    const at::Tensor in_off = combined_offsets(l, r, B, v);
    at::Tensor out_l = at::empty(with_rows(tl, v, 1), v.options()), out_r = at::empty(with_rows(tr, v, 1), v.options());
    tfj_copy_params p = copy_params(TFJ_SPLIT, T, v, row_elems(v, 1));
    p.n_samples = B;
    p.offsets = in_off.data_ptr<int64_t>();
    p.src = part_of(v, nullptr, 0);
    p.n_parts = 2;
    p.parts[0] = part_of(out_l, l.off.defined() ? &l.off : nullptr, l.dense_len);
    p.parts[1] = part_of(out_r, r.off.defined() ? &r.off : nullptr, r.dense_len);
    p.prefix = n_prefix_to_right;
    run_copy(be, p);
    return {out_l, out_r};
}

namespace {

void check_list(at::TensorList values_list, at::TensorList offsets_list, const char *op) {
    TORCH_CHECK(!values_list.empty(), op, ": values_list must not be empty");
    TORCH_CHECK(values_list.size() == offsets_list.size(), op, ": values_list and offsets_list must have the same "
                "length, got ", values_list.size(), " and ", offsets_list.size());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> concat(const JaggedBackend &be, at::TensorList values_list,
                                          at::TensorList offsets_list) {
    const char *op = "torchfuse.jagged_concat";
    check_list(values_list, offsets_list, op);
    const at::Tensor &v0 = values_list[0];
    check_rows_2d(v0, op, "values_list[0]");
    check_values(v0, op, "values_list[0]");
    std::vector<at::Tensor> vals, offs;
    int64_t T = 0, B = -1;
    for (size_t i = 0; i < values_list.size(); ++i) {
        const std::string vi = "values_list[" + std::to_string(i) + "]", oi = "offsets_list[" + std::to_string(i) + "]";
        check_pair(v0, values_list[i], op, "values_list[0]", vi.c_str());
        vals.push_back(values_list[i].contiguous());
        offs.push_back(offsets64(offsets_list[i], v0, op, oi.c_str()));
        const int64_t b = offs.back().size(0) - 1;
        TORCH_CHECK(B < 0 || b == B, op, ": every offsets tensor must have B+1 = ", B + 1, " entries, offsets_list[", i,
                    "] has ", b + 1);
        B = b;
        if (be.host_checks) check_offsets_host(offs.back(), vals.back().size(0), op, oi.c_str(), vi.c_str(), true);
        T += vals.back().size(0);
    }
    at::Tensor out_off = offs[0];
    for (size_t i = 1; i < offs.size(); ++i) out_off = out_off + offs[i];
    out_off = out_off.contiguous();
    at::Tensor out = at::empty(with_rows(T, v0, 1), v0.options());
    // A single launch covers the common case; more inputs are concatenated in groups, each group's
    // result becoming the first part of the next.
    at::Tensor cur, cur_off;
    size_t i = 0;
    while (i < vals.size()) {
        std::vector<at::Tensor> gv, go;
        if (cur.defined()) {
            gv.push_back(cur);
            go.push_back(cur_off);
        }
        while (i < vals.size() && gv.size() < TFJ_MAX_PARTS) {
            gv.push_back(vals[i]);
            go.push_back(offs[i]);
            ++i;
        }
        at::Tensor goff = go[0];
        int64_t gT = gv[0].size(0);
        for (size_t k = 1; k < go.size(); ++k) {
            goff = goff + go[k];
            gT += gv[k].size(0);
        }
        goff = goff.contiguous();
        at::Tensor gout = i == vals.size() ? out : at::empty(with_rows(gT, v0, 1), v0.options());
        tfj_copy_params p = copy_params(TFJ_CONCAT, gT, v0, row_elems(v0, 1));
        p.n_samples = B;
        p.offsets = goff.data_ptr<int64_t>();
        p.dst = part_of(gout, nullptr, 0);
        p.n_parts = (int)gv.size();
        for (size_t k = 0; k < gv.size(); ++k) p.parts[k] = part_of(gv[k], &go[k], 0);
        run_copy(be, p);
        cur = gout;
        cur_off = goff;
    }
    return {out, out_off.to(offsets_list[0].scalar_type())};
}

std::vector<at::Tensor> split(const JaggedBackend &be, const at::Tensor &values_in, at::TensorList offsets_list,
                              at::IntArrayRef totals) {
    const char *op = "torchfuse.jagged_split";
    check_rows_2d(values_in, op, "values");
    check_values(values_in, op, "values");
    TORCH_CHECK(!offsets_list.empty() && offsets_list.size() == totals.size(), op,
                ": offsets_list and totals must be non-empty and of the same length, got ", offsets_list.size(),
                " and ", totals.size());
    const at::Tensor v = values_in.contiguous();
    std::vector<at::Tensor> offs, outs;
    int64_t T = 0, B = -1;
    for (size_t i = 0; i < offsets_list.size(); ++i) {
        const std::string oi = "offsets_list[" + std::to_string(i) + "]", ti = "totals[" + std::to_string(i) + "]";
        offs.push_back(offsets64(offsets_list[i], v, op, oi.c_str()));
        const int64_t b = offs.back().size(0) - 1;
        TORCH_CHECK(B < 0 || b == B, op, ": every offsets tensor must have B+1 = ", B + 1, " entries, offsets_list[", i,
                    "] has ", b + 1);
        B = b;
        TORCH_CHECK(totals[i] >= 0, op, ": totals must be >= 0, got ", totals[i]);
        if (be.host_checks) check_offsets_host(offs.back(), totals[i], op, oi.c_str(), ti.c_str(), true);
        outs.push_back(at::empty(with_rows(totals[i], v, 1), v.options()));
        T += totals[i];
    }
    TORCH_CHECK(T == v.size(0), op, ": totals must add up to values.shape[0] = ", v.size(0), ", got ", T);
    // Groups of up to TFJ_MAX_PARTS outputs: each launch reads the input rows of its group's samples
    // through offsets that cover the group and everything after it folded into one trailing part.
    size_t i = 0;
    at::Tensor rest_v = v;
    while (i < offs.size()) {
        const size_t take = std::min(offs.size() - i, (size_t)(offs.size() - i <= TFJ_MAX_PARTS ? TFJ_MAX_PARTS
                                                                                                 : TFJ_MAX_PARTS - 1));
        at::Tensor all_off = offs[i];
        for (size_t k = i + 1; k < offs.size(); ++k) all_off = all_off + offs[k];
        all_off = all_off.contiguous();
        at::Tensor tail_off, tail_v;
        int64_t tail_T = 0;
        const bool has_tail = i + take < offs.size();
        if (has_tail) {
            tail_off = offs[i + take];
            for (size_t k = i + take; k < offs.size(); ++k) {
                if (k > i + take) tail_off = tail_off + offs[k];
                tail_T += totals[k];
            }
            tail_off = tail_off.contiguous();
            tail_v = at::empty(with_rows(tail_T, v, 1), v.options());
        }
        tfj_copy_params p = copy_params(TFJ_SPLIT, rest_v.size(0), v, row_elems(v, 1));
        p.n_samples = B;
        p.offsets = all_off.data_ptr<int64_t>();
        p.src = part_of(rest_v, nullptr, 0);
        p.n_parts = (int)take + (has_tail ? 1 : 0);
        for (size_t k = 0; k < take; ++k) p.parts[k] = part_of(outs[i + k], &offs[i + k], 0);
        if (has_tail) p.parts[take] = part_of(tail_v, &tail_off, 0);
        run_copy(be, p);
        i += take;
        rest_v = tail_v;
    }
    return outs;
}

std::tuple<at::Tensor, at::Tensor> index_select(const JaggedBackend &be, const at::Tensor &values_in,
                                                const at::Tensor &lengths, const at::Tensor &indices,
                                                std::optional<int64_t> total_length) {
    const char *op = "torchfuse.jagged_index_select";
    check_rows_2d(values_in, op, "values");
    check_values(values_in, op, "values");
    TORCH_CHECK(lengths.dim() == 1, op, ": lengths must be 1-D, got shape ", lengths.sizes());
    TORCH_CHECK_TYPE(lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong, op,
                     ": lengths must be int32 or int64, got ", lengths.scalar_type());
    TORCH_CHECK(indices.dim() == 1, op, ": indices must be 1-D, got shape ", indices.sizes());
    TORCH_CHECK_TYPE(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong, op,
                     ": indices must be int32 or int64, got ", indices.scalar_type());
    check_same_device(lengths, values_in, op, "lengths", "values");
    check_same_device(indices, values_in, op, "indices", "values");
    const at::Tensor v = values_in.contiguous();
    const int64_t n_in = lengths.size(0), K = indices.size(0);
    const at::Tensor len64 = lengths.to(at::kLong), idx = indices.to(at::kLong).contiguous();
    const at::Tensor in_off = at::cat({at::zeros({1}, len64.options()), at::cumsum(len64, 0)}).contiguous();
    if (be.host_checks) {
        if (n_in > 0) {
            const int64_t lo = len64.min().item<int64_t>();
            TORCH_CHECK(lo >= 0, op, ": lengths must be >= 0, got ", lo);
        }
        TORCH_CHECK(last_entry(in_off) <= v.size(0), op, ": sum(lengths) = ", last_entry(in_off),
                    " is more than values.shape[0] = ", v.size(0));
        if (K > 0) {
            const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
            TORCH_CHECK(lo >= 0 && hi < n_in, op, ": indices must be in [0, ", n_in, "), got values in [", lo, ", ", hi,
                        "]");
        }
    }
    // Selected lengths; out-of-range indices (possible on the GPU path only) select nothing.
    at::Tensor out_len;
    if (n_in > 0) {
        const at::Tensor ok = (idx >= 0).logical_and(idx < n_in);
        out_len = len64.index_select(0, idx.clamp(0, n_in - 1)).clamp_min(0) * ok;
    } else {
        out_len = at::zeros({K}, len64.options());
    }
    const at::Tensor out_off = at::cat({at::zeros({1}, len64.options()), at::cumsum(out_len, 0)}).contiguous();
    int64_t T;
    if (total_length.has_value()) {
        T = *total_length;
        TORCH_CHECK(T >= 0, op, ": total_length must be >= 0, got ", T);
        if (be.host_checks)
            TORCH_CHECK(last_entry(out_off) == T, op, ": total_length = ", T,
                        " but the selected samples hold ", last_entry(out_off), " rows");
    } else {
        T = last_entry(out_off);
    }
    at::Tensor out = at::empty(with_rows(T, v, 1), v.options());
    tfj_copy_params p = copy_params(TFJ_INDEX, T, v, row_elems(v, 1));
    p.n_samples = K;
    p.offsets = out_off.data_ptr<int64_t>();
    p.src = part_of(v, nullptr, 0);
    p.dst = part_of(out, nullptr, 0);
    p.in_offsets = in_off.data_ptr<int64_t>();
    p.indices = idx.data_ptr<int64_t>();
    p.n_in = n_in;
    run_copy(be, p);
    return {out, out_len.to(lengths.scalar_type())};
}

}  // namespace jagged

namespace {

void copy_cpu(const tfj_copy_params &p) {
    // rows per task chunk: enough bytes per chunk that threading pays
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, p.row_bytes));
    at::parallel_for(0, p.tasks, grain, [&](int64_t b, int64_t e) { tfj_copy_cpu(&p, b, e); });
}

void arith_cpu(const tfj_arith_params &p) {
    const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, p.cols));
    at::parallel_for(0, p.rows, grain, [&](int64_t b, int64_t e) { tfj_arith_cpu(&p, b, e); });
}

const JaggedBackend kCpu{copy_cpu, arith_cpu, true};

at::Tensor complete_cumsum_cpu(const at::Tensor &lengths) { return jagged::complete_cumsum(kCpu, lengths); }
at::Tensor to_padded_cpu(const at::Tensor &v, const at::Tensor &o, int64_t L, double pad) {
    return jagged::to_padded_dense(kCpu, v, o, L, pad);
}
at::Tensor to_jagged_cpu(const at::Tensor &d, const at::Tensor &o, std::optional<int64_t> T) {
    return jagged::dense_to_jagged(kCpu, d, o, T);
}
at::Tensor add_cpu(const at::Tensor &v, const at::Tensor &o, const at::Tensor &d) {
    return jagged::dense_arith(kCpu, v, o, d, false);
}
at::Tensor mul_cpu(const at::Tensor &v, const at::Tensor &o, const at::Tensor &d) {
    return jagged::dense_arith(kCpu, v, o, d, true);
}
std::tuple<at::Tensor, at::Tensor> concat_2d_cpu(const at::Tensor &vl, const std::optional<at::Tensor> &ol,
                                                 const at::Tensor &vr, const std::optional<at::Tensor> &orr,
                                                 std::optional<int64_t> ml, std::optional<int64_t> mr, int64_t pre) {
    return jagged::concat_2d(kCpu, vl, ol, vr, orr, ml, mr, pre);
}
std::tuple<at::Tensor, at::Tensor> split_2d_cpu(const at::Tensor &v, const std::optional<at::Tensor> &ol,
                                                const std::optional<at::Tensor> &orr, std::optional<int64_t> ml,
                                                std::optional<int64_t> mr, int64_t pre, std::optional<int64_t> tl,
                                                std::optional<int64_t> tr) {
    return jagged::split_2d(kCpu, v, ol, orr, ml, mr, pre, tl, tr);
}
std::tuple<at::Tensor, at::Tensor> concat_cpu(at::TensorList v, at::TensorList o) { return jagged::concat(kCpu, v, o); }
std::vector<at::Tensor> split_cpu(const at::Tensor &v, at::TensorList o, at::IntArrayRef t) {
    return jagged::split(kCpu, v, o, t);
}
std::tuple<at::Tensor, at::Tensor> index_select_cpu(const at::Tensor &v, const at::Tensor &l, const at::Tensor &i,
                                                    std::optional<int64_t> t) {
    return jagged::index_select(kCpu, v, l, i, t);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
    m.impl("complete_cumsum", &complete_cumsum_cpu);
    m.impl("jagged_to_padded_dense", &to_padded_cpu);
    m.impl("dense_to_jagged", &to_jagged_cpu);
    m.impl("jagged_dense_add", &add_cpu);
    m.impl("jagged_dense_mul", &mul_cpu);
    m.impl("concat_2d_jagged", &concat_2d_cpu);
    m.impl("split_2d_jagged", &split_2d_cpu);
    m.impl("jagged_concat", &concat_cpu);
    m.impl("jagged_split", &split_cpu);
    m.impl("jagged_index_select", &index_select_cpu);
}

}  // namespace torchfuse
