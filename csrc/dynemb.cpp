// Dynamic embedding table ops: argument checks, parameter setup, and the CPU implementation.
#include "dynemb.h"
#include "dynemb_ops.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <unordered_map>

#include "tf_check.h"

namespace torchfuse {

void check_index(const at::Tensor &t, const at::Tensor &ref, const char *op, const char *arg) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, op, ": ", arg, " must be int64, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), op, ": ", arg, " must be 1-D and contiguous, got shape ",
                t.sizes());
    check_same_device(t, ref, op, arg, "the table");
}

const char *const kDynembFieldNames[kDynembFields] = {"keys",   "digests",     "scores", "marks",     "locks",
                                                    "values", "values_host", "state",  "state_host"};

namespace {

// "table[3] (marks)", or "tables[1][3] (marks)" for table 1 of a table-batched op: built only when a
// check fails.
std::string field_name(const char *arg, int64_t index, int f) {
    std::string s(arg);
    if (index >= 0) s += "[" + std::to_string(index) + "]";
    return s + "[" + std::to_string(f) + "] (" + kDynembFieldNames[f] + ")";
}

// Two-tier rows (checked by the caller): slots below rows.size(0) in `rows`, the rest in `host`.
tf_dynemb_rows tiers(const at::Tensor &rows, const at::Tensor &host) {
    tf_dynemb_rows r{};
    r.hbm = static_cast<char *>(rows.data_ptr());
    r.host = host.numel() > 0 ? static_cast<char *>(host.data_ptr()) : nullptr;
    r.n_hbm = rows.size(0);
    r.row_bytes = rows.size(1) * rows.element_size();
    return r;
}

}  // namespace

DynembState dynemb_state(at::TensorList table, const char *op, const char *arg, int64_t index) {
    TORCH_CHECK(table.size() == kDynembFields, op, ": ", arg, " must hold the table's ", int(kDynembFields),
                " state tensors (keys, digests, scores, marks, locks, values, values_host, state, state_host), got ",
                table.size());
    auto name = [&](int f) { return field_name(arg, index, f); };
    const at::Tensor &keys = table[kKeys];
    auto check_arr = [&](int f, at::ScalarType st, int64_t n) {
        const at::Tensor &t = table[f];
        TORCH_CHECK_TYPE(t.scalar_type() == st, op, ": ", name(f), " must be ", st, ", got ", t.scalar_type());
        TORCH_CHECK(t.dim() == 1 && (n < 0 || t.numel() == n) && t.is_contiguous(), op, ": ", name(f),
                    " must be a contiguous 1-D tensor",
                    n < 0 ? std::string() : " of capacity = " + std::to_string(n) + " elements", ", got shape ",
                    t.sizes());
        TORCH_CHECK(t.device() == keys.device(), op, ": ", name(f), " must be on the device of table[0] (keys) (",
                    keys.device(), "), got ", t.device());
    };
    check_arr(kKeys, at::kLong, -1);
    const int64_t cap = keys.numel();
    check_arr(kDigests, at::kByte, cap);
    check_arr(kScores, at::kLong, cap);
    check_arr(kMarks, at::kInt, cap);
    check_arr(kLocks, at::kInt, -1);
    const int64_t nb = table[kLocks].numel();
    TORCH_CHECK(nb >= 1 && (nb & (nb - 1)) == 0 && cap % nb == 0, op, ": ", name(kLocks),
                " must hold one entry per bucket, a power of two dividing the capacity (", cap, "), got ", nb);
    const int64_t bucket_size = cap / nb;
    TORCH_CHECK(bucket_size >= 4 && bucket_size <= 128 && (bucket_size & (bucket_size - 1)) == 0, op,
                ": the bucket size (capacity ", cap, " / ", nb, " buckets) must be a power of two in [4, 128], got ",
                bucket_size);
    // rows: (n_hbm, width) on the table's device, the host part (capacity - n_hbm, width) beside them
    // (a CUDA table's host part is mapped pinned memory: dynemb_cuda.cpp's map_host checks it)
    auto rows = [&](int f, int fh) {
        const at::Tensor &r = table[f], &h = table[fh];
        TORCH_CHECK(r.dim() == 2 && r.is_contiguous(), op, ": ", name(f), " must be a contiguous 2-D tensor, got shape ",
                    r.sizes());
        TORCH_CHECK(r.device() == keys.device(), op, ": ", name(f), " must be on the device of table[0] (keys) (",
                    keys.device(), "), got ", r.device());
        TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) == r.size(1) && h.scalar_type() == r.scalar_type(),
                    op, ": ", name(fh), " must be contiguous with rows of ", r.size(1), " ", r.scalar_type(), ", got ",
                    h.scalar_type(), " ", h.sizes());
        TORCH_CHECK(r.size(0) + h.size(0) == cap, op, ": ", name(f), " and ", name(fh),
                    " must hold one row per slot (", cap, "), got ", r.size(0), " + ", h.size(0));
        return tiers(r, h);
    };
    const at::Tensor &values = table[kValues], &state = table[kState];
    const at::ScalarType vt = values.scalar_type();
    TORCH_CHECK_TYPE(vt == at::kFloat || vt == at::kHalf || vt == at::kBFloat16, op, ": ", name(kValues),
                     " must be float32, float16 or bfloat16, got ", vt);
    TORCH_CHECK_TYPE(state.scalar_type() == at::kFloat, op, ": ", name(kState), " must be float32, got ",
                     state.scalar_type());
    DynembState st{};
    st.f = table.data();
    st.c.values = rows(kValues, kValuesHost);
    st.c.state = rows(kState, kStateHost);
    TORCH_CHECK(state.size(0) == values.size(0), op, ": ", name(kState), " and ", name(kValues),
                " must split device/host rows alike, got ", state.size(0), " and ", values.size(0), " device rows");
    st.c.dtype = kernel_dtype(vt, op, "values");
    st.c.dim = values.size(1);
    st.c.state_dim = state.size(1);
    tf_dynemb_table &t = st.c.t;
    t.keys = keys.data_ptr<int64_t>();
    t.digests = table[kDigests].data_ptr<uint8_t>();
    t.scores = table[kScores].data_ptr<int64_t>();
    t.marks = table[kMarks].data_ptr<int32_t>();
    t.locks = table[kLocks].data_ptr<int32_t>();
    t.num_buckets = nb;
    t.bucket_size = static_cast<int>(bucket_size);
    return st;
}

std::vector<DynembState> dynemb_states(at::TensorList tables, const char *op) {
    const size_t n = tables.size() / kDynembFields;
    TORCH_CHECK(n >= 1 && tables.size() % kDynembFields == 0, op, ": tables must hold ", int(kDynembFields),
                " state tensors per table (at least one table), got ", tables.size());
    std::vector<DynembState> st;
    st.reserve(n);
    for (size_t i = 0; i < n; ++i)
        st.push_back(dynemb_state(tables.slice(i * kDynembFields, kDynembFields), op, "tables", (int64_t)i));
    return st;
}

const int64_t *dynemb_order(const std::optional<at::Tensor> &order, const at::Tensor &slots, const char *op) {
    if (!order.has_value()) return nullptr;
    const at::Tensor &o = *order;
    TORCH_CHECK_TYPE(o.scalar_type() == at::kLong, op, ": order must be int64, got ", o.scalar_type());
    TORCH_CHECK(o.dim() == 1, op, ": order must be 1-D, got shape ", o.sizes());
    TORCH_CHECK(o.numel() == slots.numel(), op, ": order must have as many entries as slots (", slots.numel(),
                "), got ", o.numel());
    check_same_device(o, slots, op, "order", "slots");
    TORCH_CHECK(o.is_contiguous(), op, ": order must be contiguous");
    return o.data_ptr<int64_t>();
}

DynembRowCopy dynemb_row_copy(const at::Tensor &slots, const at::Tensor &rows, const at::Tensor &rows_host,
                              const std::optional<at::Tensor> &order, const char *op) {
    check_index(slots, rows, op, "slots");
    DynembRowCopy c{};
    c.r = dynemb_rows(rows, rows_host, rows, op, "rows");
    c.order = dynemb_order(order, slots, op);
    return c;
}

at::Tensor dynemb_scatter_src(const at::Tensor &src, const at::Tensor &slots, const at::Tensor &rows) {
    const char *op = "torchfuse.dynemb_scatter";
    check_same_device(src, rows, op, "src", "rows");
    TORCH_CHECK(src.dim() == 2 && src.size(0) == slots.numel() && src.size(1) == rows.size(1) &&
                    src.scalar_type() == rows.scalar_type(),
                op, ": src must be (", slots.numel(), ", ", rows.size(1), ") ", rows.scalar_type(), ", got ",
                src.scalar_type(), " ", src.sizes());
    return src.contiguous();
}

std::vector<int64_t> row_shape(const at::Tensor &rows, int64_t n) {
    std::vector<int64_t> s(rows.sizes().begin(), rows.sizes().end());
    s[0] = n;
    return s;
}

tf_dynemb_rows dynemb_rows(const at::Tensor &rows, const at::Tensor &rows_host, const at::Tensor &ref,
                           const char *op, const char *arg) {
    TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(), op, ": ", arg, " must be a contiguous 2-D tensor, got ",
                rows.sizes());
    check_same_device(rows, ref, op, arg, "the table");
    TORCH_CHECK(rows_host.dim() == 2 && rows_host.is_contiguous() && rows_host.size(1) == rows.size(1) &&
                    rows_host.scalar_type() == rows.scalar_type(),
                op, ": the host part of ", arg, " must be contiguous with rows of ", rows.size(1), " ",
                rows.scalar_type(), ", got ", rows_host.scalar_type(), " ", rows_host.sizes());
    // a CUDA table's host part must be mapped pinned memory: dynemb_cuda.cpp's map_host checks it
    return tiers(rows, rows_host);
}

tf_dynemb_init_params dynemb_init_params(const at::Tensor &slots, const at::Tensor &keys,
                                         const std::optional<at::Tensor> &mask, const DynembState &st,
                                         int64_t init_kind, double a, double b, int64_t seed, const char *op,
                                         const char *mask_arg) {
    const at::Tensor &values = st[kValues];
    check_index(slots, values, op, "slots");
    check_index(keys, values, op, "keys");
    TORCH_CHECK(keys.numel() == slots.numel(), op, ": keys and slots must have the same length");
    TORCH_CHECK(init_kind >= TF_INIT_NONE && init_kind <= TF_INIT_CONSTANT, op, ": bad init_kind ", init_kind);
    tf_dynemb_init_params p{};
    p.n = slots.numel();
    p.slots = slots.data_ptr<int64_t>();
    p.keys = keys.data_ptr<int64_t>();
    if (mask.has_value()) {
        TORCH_CHECK(mask->scalar_type() == at::kByte && mask->numel() == p.n && mask->is_contiguous(), op, ": ",
                    mask_arg, " must be a contiguous uint8 tensor of ", p.n, " elements, got ", mask->scalar_type(),
                    " ", mask->sizes());
        check_same_device(*mask, values, op, mask_arg, "the table");
        p.mask = mask->data_ptr<uint8_t>();
    }
    p.values = st.c.values;
    p.dtype = st.c.dtype;
    p.dim = st.c.dim;
    p.state = st.c.state;
    p.init_kind = (int)init_kind;
    p.a = a;
    p.b = b;
    p.seed = (uint64_t)seed;
    return p;
}

tf_dynemb_init_params dynemb_init_gather_params(const at::Tensor &slots, const at::Tensor &keys,
                                                const at::Tensor &is_new, const DynembState &st, int64_t init_kind,
                                                double a, double b, int64_t seed, const std::optional<at::Tensor> &order,
                                                const int64_t **ord, at::Tensor &out) {
    const char *op = "torchfuse.dynemb_init_gather";
    TORCH_CHECK(is_new.dim() == 1, op, ": is_new must be 1-D, got shape ", is_new.sizes());
    tf_dynemb_init_params p = dynemb_init_params(slots, keys, is_new, st, init_kind, a, b, seed, op, "is_new");
    *ord = dynemb_order(order, slots, op);
    out = at::empty(row_shape(st[kValues], slots.numel()), st[kValues].options());
    return p;
}

tf_dynemb_update_params dynemb_update_params(const at::Tensor &slots, const at::Tensor *grad, const DynembState &st,
                                             int64_t opt, double lr, double eps, double beta1, double beta2,
                                             double step_size, const char *op) {
    const at::Tensor &values = st[kValues];
    check_index(slots, values, op, "slots");
    tf_dynemb_update_params p{};
    p.values = st.c.values;
    p.dtype = st.c.dtype;
    p.dim = st.c.dim;
    if (grad) {  // NULL: the gradient comes from a fused segment sum
        check_same_device(*grad, values, op, "grad", "the table");
        TORCH_CHECK(grad->dim() == 2 && grad->size(0) == slots.numel() && grad->size(1) == p.dim &&
                        grad->stride(1) == 1,
                    op, ": grad must be (", slots.numel(), ", ", p.dim, ") with unit column stride, got ",
                    grad->sizes());
        p.grad_dtype = kernel_dtype(grad->scalar_type(), op, "grad");
        p.grad = grad->data_ptr();
        p.grad_stride = grad->stride(0);
    }
    p.state = st.c.state;
    const int64_t need = opt == TF_OPT_SGD ? 0 : opt == TF_OPT_ADAGRAD ? p.dim : opt == TF_OPT_ROWWISE_ADAGRAD ? 1
                                                 : opt == TF_OPT_ADAM         ? 2 * p.dim
                                                                              : -1;
    TORCH_CHECK(need >= 0, op, ": unknown optimizer code ", opt);
    TORCH_CHECK(st.c.state_dim == need, op, ": the optimizer needs ", need,
                " state floats per row in table[7] (state), got ", st.c.state_dim);
    p.n = slots.numel();
    p.slots = slots.data_ptr<int64_t>();
    p.opt = (int)opt;
    p.lr = (float)lr;
    p.eps = (float)eps;
    p.beta1 = (float)beta1;
    p.beta2 = (float)beta2;
    p.step_size = (float)step_size;
    return p;
}

tf_dynemb_pool_params dynemb_pool_params(const at::Tensor &slots, const at::Tensor &offsets,
                                         const std::optional<at::Tensor> &weights, const at::Tensor &rows,
                                         const at::Tensor &rows_host, bool mean, at::Tensor &out,
                                         const std::optional<at::Tensor> &inv) {
    const char *op = "torchfuse.dynemb_pool";
    check_index(slots, rows, op, "slots");
    check_index(offsets, rows, op, "offsets");
    TORCH_CHECK(offsets.numel() >= 1, op, ": offsets must hold n_bags + 1 entries");
    tf_dynemb_pool_params p{};
    p.n_bags = offsets.numel() - 1;
    p.slots = slots.data_ptr<int64_t>();
    p.offsets = offsets.data_ptr<int64_t>();
    p.n_ids = slots.numel();
    if (inv.has_value()) {  // ids through their unique index: slots are the unique ids' slots
        check_index(*inv, rows, op, "inv");
        p.inv = inv->data_ptr<int64_t>();
        p.n_ids = inv->numel();
        p.n_slots = slots.numel();
    }
    if (weights.has_value()) {
        TORCH_CHECK(weights->scalar_type() == at::kFloat && weights->numel() == p.n_ids &&
                        weights->is_contiguous(),
                    op, ": weights must be contiguous float32 with one entry per id");
        check_same_device(*weights, rows, op, "weights", "the table");
        p.weights = weights->data_ptr<float>();
    }
    p.mean = mean;
    p.values = dynemb_rows(rows, rows_host, rows, op, "rows");
    p.dtype = kernel_dtype(rows.scalar_type(), op, "rows");
    p.dim = rows.size(1);
    out = at::empty({p.n_bags, p.dim}, rows.options());
    p.out = out.data_ptr();
    p.out_dtype = p.dtype;
    p.out_block_bags = p.n_bags > 0 ? p.n_bags : 1;
    p.out_row_stride = p.dim;
    return p;
}

tf_dynemb_segsum_params dynemb_segsum_params(const at::Tensor &grad, const at::Tensor &perm, const at::Tensor &seg,
                                             const std::optional<at::Tensor> &bag_of,
                                             const std::optional<at::Tensor> &scale, at::Tensor *out) {
    const char *op = "torchfuse.dynemb_segment_sum";
    TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous(), op, ": grad must be a contiguous 2-D tensor");
    check_index(perm, grad, op, "perm");
    check_index(seg, grad, op, "seg");
    TORCH_CHECK(seg.numel() >= 1, op, ": seg must hold n_unique + 1 entries");
    tf_dynemb_segsum_params p{};
    p.n_unique = seg.numel() - 1;
    p.dim = grad.size(1);
    p.n_occ = perm.numel();
    p.perm = perm.data_ptr<int64_t>();
    p.seg = seg.data_ptr<int64_t>();
    if (bag_of.has_value()) {
        check_index(*bag_of, grad, op, "bag_of");
        TORCH_CHECK(bag_of->numel() == perm.numel(), op, ": bag_of must have one entry per id");
        p.bag_of = bag_of->data_ptr<int64_t>();
    } else {
        TORCH_CHECK(grad.size(0) == perm.numel(), op, ": grad must have one row per id without bag_of");
    }
    if (scale.has_value()) {
        TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == perm.numel() && scale->is_contiguous(), op,
                    ": scale must be contiguous float32 with one entry per id");
        check_same_device(*scale, grad, op, "scale", "grad");
        p.scale = scale->data_ptr<float>();
    }
    p.grad = grad.data_ptr();
    p.grad_dtype = kernel_dtype(grad.scalar_type(), op, "grad");
    if (out) {  // NULL: fused with the update, no sums written
        *out = at::empty({p.n_unique, p.dim}, grad.options().dtype(at::kFloat));
        p.out = out->data_ptr<float>();
    }
    return p;
}

DynembInsert prepare_dynemb_insert(const at::Tensor &query, at::Tensor &slots, const DynembState &st, int64_t epoch,
                                   bool allow_evict, bool filled) {
    const char *op = "torchfuse.dynemb_insert";
    DynembInsert ins{};
    ins.t = st.c.t;
    check_index(query, st[kKeys], op, "query");
    check_index(slots, st[kKeys], op, "slots");
    TORCH_CHECK(slots.numel() == query.numel(), op, ": slots must have one entry per query key");
    const int64_t n = query.numel();
    // entries past the evicted count hold -1 (defined contents: the op is then a function of its inputs);
    // !filled: the caller's first kernel writes these contents (one launch instead of five fills)
    ins.is_new = filled ? at::zeros({n}, query.options().dtype(at::kByte)) : at::empty({n}, query.options().dtype(at::kByte));
    ins.ev_keys = filled ? at::full({n}, -1, query.options()) : at::empty({n}, query.options());
    ins.ev_slots = filled ? at::full({n}, -1, query.options()) : at::empty({n}, query.options());
    ins.ev_scores = filled ? at::full({n}, -1, query.options()) : at::empty({n}, query.options());
    ins.counts = filled ? at::zeros({3}, query.options()) : at::empty({3}, query.options());
    tf_dynemb_probe &p = ins.p;
    p.n = n;
    p.query = query.data_ptr<int64_t>();
    p.slots = slots.data_ptr<int64_t>();
    p.epoch = (int32_t)epoch;
    p.allow_evict = allow_evict;
    p.is_new = ins.is_new.data_ptr<uint8_t>();
    p.evicted_keys = ins.ev_keys.data_ptr<int64_t>();
    p.evicted_slots = ins.ev_slots.data_ptr<int64_t>();
    p.evicted_scores = ins.ev_scores.data_ptr<int64_t>();
    p.counts = ins.counts.data_ptr<int64_t>();
    return ins;
}

tf_dynemb_evict_params dynemb_evict_params(const at::Tensor &slots, const at::Tensor &new_index, const at::Tensor &keys,
                                           const DynembState &st, at::Tensor &rows, int64_t init_kind, double a,
                                           double b, int64_t seed, at::Tensor &old_values, at::Tensor &old_state) {
    const char *op = "torchfuse.dynemb_find_or_insert_sync (eviction rows)";
    const at::Tensor &values = st[kValues], &state = st[kState];
    check_index(slots, values, op, "slots");
    check_index(new_index, values, op, "new_index");
    check_index(keys, values, op, "keys");
    TORCH_CHECK(new_index.numel() == slots.numel(), op, ": new_index must have one entry per slot (", slots.numel(),
                "), got ", new_index.numel());
    tf_dynemb_evict_params p{};
    p.init = dynemb_init_params(slots, slots, std::nullopt, st, init_kind, a, b, seed, op);
    p.n = slots.numel();
    p.slots = slots.data_ptr<int64_t>();
    p.new_index = new_index.data_ptr<int64_t>();
    p.keys = keys.data_ptr<int64_t>();
    check_same_device(rows, values, op, "rows", "the table");
    TORCH_CHECK(rows.numel() == 0 || (rows.dim() == 2 && rows.size(0) == keys.numel() && rows.size(1) == values.size(1) &&
                                      rows.scalar_type() == values.scalar_type() && rows.is_contiguous()),
                op, ": rows must be empty or contiguous (", keys.numel(), ", ", values.size(1), ") ",
                values.scalar_type(), ", got ", rows.scalar_type(), " ", rows.sizes());
    p.rows_out = rows.numel() ? rows.data_ptr() : nullptr;
    old_values = at::empty({p.n, values.size(1)}, values.options());
    old_state = at::empty({p.n, state.size(1)}, state.options());
    p.old_values = old_values.data_ptr();
    p.old_state = old_state.data_ptr<float>();
    return p;
}

DynembFoi prepare_find_or_insert(const at::Tensor &query, const DynembState &st, const DynembFoiArgs &args,
                                 bool filled, bool evicted_list) {
    const char *op = "torchfuse.dynemb_find_or_insert_sync";
    TORCH_CHECK(args.policy >= -1 && args.policy <= TF_DYNEMB_LFU, op,
                ": policy must be -1 (no touch), 0 (LRU) or 1 (LFU)");
    TORCH_CHECK(args.epoch > 0, op, ": epoch must be > 0 (found keys are marked with it)");
    check_index(query, st[kKeys], op, "query");
    const at::Tensor &values = st[kValues];
    const bool with_rows = args.with_rows;
    DynembFoi f{};
    f.t = st.c.t;
    const int64_t n = query.numel();
    const at::TensorOptions o = query.options();
    f.slots = at::empty({n}, o);  // the probe writes every entry
    // entries past the evicted count hold -1 (defined contents: the op is then a function of its inputs);
    // !filled: the caller's first kernel writes these contents (one launch instead of three fills)
    f.is_new = filled ? at::zeros({n}, o.dtype(at::kByte)) : at::empty({n}, o.dtype(at::kByte));
    // !evicted_list (CUDA, 128-slot buckets, a caller keeping no evictions): the kernels write no list
    const int64_t n_list = evicted_list ? n : 0;
    f.evicted = filled ? at::full({4, n_list}, -1, o) : at::empty({4, n_list}, o);
    f.counts = filled ? at::zeros({3}, o) : at::empty({3}, o);
    tf_dynemb_probe &p = f.p.p;
    p.n = n;
    p.query = query.data_ptr<int64_t>();
    p.slots = f.slots.data_ptr<int64_t>();
    p.epoch = (int32_t)args.epoch;
    p.allow_evict = args.allow_evict;
    p.is_new = f.is_new.data_ptr<uint8_t>();
    int64_t *ev = evicted_list ? f.evicted.data_ptr<int64_t>() : nullptr;
    p.evicted_keys = ev;
    p.evicted_slots = ev ? ev + n : nullptr;
    p.evicted_scores = ev ? ev + 2 * n : nullptr;
    f.p.evicted_new = ev ? ev + 3 * n : nullptr;
    f.p.keep_victims = 1;
    p.counts = f.counts.data_ptr<int64_t>();
    f.p.init = dynemb_init_params(f.slots, query, std::nullopt, st, args.init_kind, args.a, args.b, args.seed, op);
    f.p.policy = static_cast<int>(args.policy);
    f.p.clock = args.clock;
    f.rows = at::empty(row_shape(values, with_rows ? n : 0), values.options());
    f.p.out = with_rows ? f.rows.data_ptr() : nullptr;
    return f;
}

DynembFoiLimits dynemb_foi_limits(const DynembState &st, const std::optional<at::Tensor> &n_valid,
                                  const std::optional<at::Tensor> &abort) {
    const at::Tensor &keys = st[kKeys];
    const char *op = "torchfuse.dynemb_find_or_insert_sync";
    DynembFoiLimits lim;
    if (n_valid.has_value()) {
        const at::Tensor &t = *n_valid;
        TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, op, ": n_valid must be int64, got ", t.scalar_type());
        TORCH_CHECK(t.numel() == 1 && t.is_contiguous(), op, ": n_valid must hold one element, got shape ", t.sizes());
        check_same_device(t, keys, op, "n_valid", "the table");
        lim.n_valid = t.data_ptr<int64_t>();
    }
    if (abort.has_value()) {
        const at::Tensor &t = *abort;
        TORCH_CHECK_TYPE(t.scalar_type() == at::kBool || t.scalar_type() == at::kByte, op,
                         ": abort must be bool or uint8, got ", t.scalar_type());
        TORCH_CHECK(t.numel() == 1 && t.is_contiguous(), op, ": abort must hold one element, got shape ", t.sizes());
        check_same_device(t, keys, op, "abort", "the table");
        lim.abort = static_cast<const uint8_t *>(t.data_ptr());
    }
    return lim;
}

namespace {

// The CPU's kernel runners (dynemb_ops.h), the batch split over threads where its items are independent.
struct DynembCpu {
    struct Guard {
        explicit Guard(at::Device) {}
    };
    static DynembState row_state(at::TensorList table, const char *op) { return dynemb_state(table, op); }
    static void lookup(const tf_dynemb_table &t, const tf_dynemb_probe &p) {
        at::parallel_for(0, p.n, 2048, [&](int64_t b, int64_t e) { tf_dynemb_lookup_cpu(&t, &p, b, e); });
    }
    static void insert(const tf_dynemb_table &t, const tf_dynemb_probe &p) { tf_dynemb_insert_cpu(&t, &p); }
    static void touch(int64_t *scores, const int64_t *slots, int64_t n, int policy, int64_t clock) {
        tf_dynemb_touch_cpu(scores, slots, n, policy, clock);
    }
    static void init(const tf_dynemb_init_params &p) {
        at::parallel_for(0, p.n, 64, [&](int64_t b0, int64_t e0) { tf_dynemb_init_cpu(&p, b0, e0); });
    }
    static void init_gather(const tf_dynemb_init_params &p, const int64_t *ord, void *out) {
        // rows are unique per call (the caller's keys are distinct), so ranges never write the same row
        at::parallel_for(0, p.n, 64, [&](int64_t b0, int64_t e0) { tf_dynemb_init_gather_cpu(&p, ord, out, b0, e0); });
    }
    static void evict_rows(const tf_dynemb_evict_params &p) {
        at::parallel_for(0, p.n, 64, [&](int64_t b0, int64_t e0) { tf_dynemb_evict_rows_cpu(&p, b0, e0); });
    }
    static void update(const tf_dynemb_update_params &p) {
        at::parallel_for(0, p.n, 64, [&](int64_t b, int64_t e) { tf_dynemb_update_cpu(&p, b, e); });
    }
};
using CpuOps = DynembOps<DynembCpu>;

at::Tensor gather_cpu(const at::Tensor &slots, const at::Tensor &rows, const at::Tensor &rows_host,
                      const std::optional<at::Tensor> &order) {
    const auto [r, ord] = dynemb_row_copy(slots, rows, rows_host, order, "torchfuse.dynemb_gather");
    at::Tensor out = at::empty(row_shape(rows, slots.numel()), rows.options());
    if (r.row_bytes == 0) return out;
    const int64_t *s = slots.data_ptr<int64_t>();
    const int64_t n = slots.numel();
    at::parallel_for(0, n, 1024, [&](int64_t b, int64_t e) { tf_dynemb_gather_cpu(&r, s, ord, n, out.data_ptr(), b, e); });
    return out;
}

void scatter_cpu(const at::Tensor &slots, const at::Tensor &src, at::Tensor &rows, at::Tensor &rows_host,
                 const std::optional<at::Tensor> &order) {
    const auto [r, ord] = dynemb_row_copy(slots, rows, rows_host, order, "torchfuse.dynemb_scatter");
    const at::Tensor s = dynemb_scatter_src(src, slots, rows);
    if (r.row_bytes == 0) return;
    const int64_t *sl = slots.data_ptr<int64_t>();
    const int64_t n = slots.numel();
    // rows are unique per call (the caller dedups), so ranges never write the same row
    at::parallel_for(0, n, 1024, [&](int64_t b, int64_t e) { tf_dynemb_scatter_cpu(&r, sl, ord, n, s.data_ptr(), b, e); });
}

std::tuple<at::Tensor, at::Tensor> find_cpu(const at::Tensor &query, at::TensorList table) {
    const char *op = "torchfuse.dynemb_find";
    const DynembState st = dynemb_state(table, op);
    const at::Tensor slots = CpuOps::probe(query, st, 0, op);
    return {gather_cpu(slots, st[kValues], st[kValuesHost], std::nullopt), slots};
}

at::Tensor pool_cpu(const at::Tensor &slots, const at::Tensor &offsets, const std::optional<at::Tensor> &weights,
                    const at::Tensor &rows, const at::Tensor &rows_host, bool mean, const std::optional<at::Tensor> &inv) {
    at::Tensor out;
    tf_dynemb_pool_params p = dynemb_pool_params(slots, offsets, weights, rows, rows_host, mean, out, inv);
    at::parallel_for(0, p.n_bags, 16, [&](int64_t b, int64_t e) { tf_dynemb_pool_cpu(&p, b, e); });
    return out;
}

at::Tensor segsum_cpu(const at::Tensor &grad, const at::Tensor &perm, const at::Tensor &seg,
                      const std::optional<at::Tensor> &bag_of, const std::optional<at::Tensor> &scale) {
    at::Tensor out;
    tf_dynemb_segsum_params p = dynemb_segsum_params(grad, perm, seg, bag_of, scale, &out);
    at::parallel_for(0, p.n_unique, 16, [&](int64_t b, int64_t e) { tf_dynemb_segsum_cpu(&p, b, e); });
    return out;
}

void segment_update_cpu(const at::Tensor &grad, const at::Tensor &perm, const at::Tensor &seg,
                        const std::optional<at::Tensor> &bag_of, const std::optional<at::Tensor> &scale,
                        const at::Tensor &slots, at::TensorList table, int64_t opt, double lr, double eps, double beta1,
                        double beta2, double step_size) {
    const DynembState st = dynemb_state(table, "torchfuse.dynemb_segment_update");
    CpuOps::update_state(slots, segsum_cpu(grad, perm, seg, bag_of, scale), st, opt, lr, eps, beta1, beta2,
                         step_size);
}

// The reference order of tf_dynemb_foi_params: lookup (marks), insert, init of the new rows (those
// that evicted nobody, when keep_victims), touch, rows out.
DynembFoiResult find_or_insert_kept_cpu(const at::Tensor &query, const DynembState &st, const DynembFoiArgs &args,
                                        bool keep_victims) {
    DynembFoi f = prepare_find_or_insert(query, st, args);
    const int64_t n = query.numel();
    tf_dynemb_lookup_cpu(&f.t, &f.p.p, 0, n);
    tf_dynemb_insert_cpu(&f.t, &f.p.p);
    // which key took each evicted slot; those rows wait for the caller
    const int64_t n_ev = f.p.p.counts[1];
    at::Tensor mask = f.is_new.clone();
    if (n_ev) {
        std::unordered_map<int64_t, int64_t> key_of_slot;
        const int64_t *sl = f.slots.data_ptr<int64_t>();
        const uint8_t *nw = f.is_new.data_ptr<uint8_t>();
        for (int64_t i = 0; i < n; ++i)
            if (nw[i]) key_of_slot[sl[i]] = i;
        for (int64_t e = 0; e < n_ev; ++e) {
            const int64_t i = key_of_slot.at(f.p.p.evicted_slots[e]);
            f.p.evicted_new[e] = i;
            if (keep_victims) mask.data_ptr<uint8_t>()[i] = 0;
        }
    }
    f.p.init.mask = mask.data_ptr<uint8_t>();
    tf_dynemb_init_cpu(&f.p.init, 0, n);
    if (args.policy >= 0)
        tf_dynemb_touch_cpu(f.t.scores, f.slots.data_ptr<int64_t>(), n, (int)args.policy, args.clock);
    if (args.with_rows && f.p.init.values.row_bytes)
        tf_dynemb_gather_cpu(&f.p.init.values, f.slots.data_ptr<int64_t>(), nullptr, n, f.rows.data_ptr(), 0, n);
    return f.result();
}

DynembFoiSyncResult find_or_insert_sync_cpu(const at::Tensor &query, at::TensorList table, int64_t epoch,
                                            bool allow_evict, int64_t policy, int64_t clock, int64_t init_kind,
                                            double a, double b, int64_t seed, bool with_rows,
                                            const std::optional<at::Tensor> &n_valid,
                                            const std::optional<at::Tensor> &abort, bool keep_evicted) {
    const DynembState st = dynemb_state(table, "torchfuse.dynemb_find_or_insert_sync");
    const DynembFoiArgs args{epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows};
    const DynembFoiLimits lim = dynemb_foi_limits(st, n_valid, abort);
    const bool aborted = lim.abort && *lim.abort;
    const int64_t n = aborted ? 0 : lim.n_valid ? std::min(std::max<int64_t>(*lim.n_valid, 0), query.numel()) : query.numel();
    // the keys taken, as the CUDA kernels take them (the CPU reads the limits directly)
    const at::Tensor q = n == query.numel() ? query : query.narrow(0, 0, n);
    const DynembFoiResult r = find_or_insert_kept_cpu(q, st, args, keep_evicted);
    const int64_t *h = std::get<4>(r).data_ptr<int64_t>();
    const int64_t c[5] = {h[0], h[1], h[2], n, aborted ? 1 : 0};
    return finish_find_or_insert(r, c, st, keep_evicted, [&](const at::Tensor &sl, const at::Tensor &ni, at::Tensor &rows) {
        return CpuOps::evict_rows(sl, ni, q, st, rows, init_kind, a, b, seed);
    });
}

DynembFoiPoolResult find_or_insert_pool_cpu(const at::Tensor &query, at::TensorList table, int64_t epoch,
                                            bool allow_evict, int64_t policy, int64_t clock, int64_t init_kind,
                                            double a, double b, int64_t seed, bool with_rows,
                                            const std::optional<at::Tensor> &n_valid,
                                            const std::optional<at::Tensor> &abort, const at::Tensor &pool_offsets,
                                            const at::Tensor &pool_inv, const std::optional<at::Tensor> &pool_weights,
                                            bool pool_mean, bool keep_evicted) {
    DynembFoiSyncResult r = find_or_insert_sync_cpu(query, table, epoch, allow_evict, policy, clock, init_kind, a, b,
                                                    seed, with_rows, n_valid, abort, keep_evicted);
    return std::tuple_cat(r, std::make_tuple(pool_cpu(std::get<0>(r), pool_offsets, pool_weights, table[kValues],
                                                      table[kValuesHost], pool_mean, pool_inv)));
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
    m.impl("dynemb_find_or_insert_pool", &find_or_insert_pool_cpu);
    m.impl("dynemb_find_or_insert_sync", &find_or_insert_sync_cpu);
    m.impl("dynemb_pool", &pool_cpu);
    m.impl("dynemb_segment_sum", &segsum_cpu);
    m.impl("dynemb_find", &find_cpu);
    m.impl("dynemb_gather", &gather_cpu);
    m.impl("dynemb_scatter", &scatter_cpu);
    CpuOps::register_impls(m);
    m.impl("dynemb_segment_update", &segment_update_cpu);
}

}  // namespace torchfuse
