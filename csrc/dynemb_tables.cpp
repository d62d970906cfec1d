// Table-batched dynamic embedding ops (schemas: registration.cpp): per-table kernel parameters over
// a concatenated batch, built with the single-table checks (dynemb.cpp), and the CPU implementation
// (a loop over the tables; the CUDA one, dynemb_cuda.cpp, launches once for up to
// TF_DYNEMB_TABLES_MAX tables).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dynemb.h"
#include "tf_check.h"

namespace torchfuse {

std::vector<int64_t> tables_starts(at::IntArrayRef starts, int64_t n_items, size_t tables, const char *op) {
    TORCH_CHECK(starts.size() == tables + 1, op, ": starts must have one entry per table plus one (", tables + 1,
                "), got ", starts.size());
    TORCH_CHECK(starts[0] == 0 && starts[tables] == n_items, op, ": starts must run from 0 to the batch size (",
                n_items, "), got ", starts);
    for (size_t t = 0; t < tables; ++t)
        TORCH_CHECK(starts[t] <= starts[t + 1], op, ": starts must be non-decreasing, got ", starts);
    return std::vector<int64_t>(starts.begin(), starts.end());
}

namespace {

void check_count(size_t got, size_t tables, const char *op, const char *arg) {
    TORCH_CHECK(got == tables, op, ": ", arg, " must have one entry per table (", tables, "), got ", got);
}

}  // namespace

DynembTablesProbe prepare_tables_probe(bool insert, const at::Tensor &query, const at::Tensor *slots,
                                       at::IntArrayRef starts, const std::vector<DynembState> &st,
                                       at::IntArrayRef epochs, const std::vector<bool> &allow_evict) {
    const char *op = insert ? "torchfuse.dynemb_tables_insert" : "torchfuse.dynemb_tables_lookup";
    const size_t T = st.size();
    check_index(query, st[0][kKeys], op, "query");
    DynembTablesProbe g;
    g.start = tables_starts(starts, query.numel(), T, op);
    check_count(epochs.size(), T, op, "epochs");
    const int64_t n = query.numel();
    if (insert) {
        check_count(allow_evict.size(), T, op, "allow_evict");
        check_index(*slots, st[0][kKeys], op, "slots");
        TORCH_CHECK(slots->numel() == n, op, ": slots must have one entry per query key");
        g.slots = *slots;
        g.is_new = at::zeros({n}, query.options().dtype(at::kByte));
        g.ev_keys = at::full({n}, -1, query.options());
        g.ev_slots = at::full({n}, -1, query.options());
        g.ev_scores = at::full({n}, -1, query.options());
        g.counts = at::zeros({static_cast<int64_t>(T), 3}, query.options());
    } else {
        g.slots = at::empty({n}, query.options());
    }
    g.t.resize(T);
    g.p.resize(T);
    for (size_t i = 0; i < T; ++i) {
        const int64_t s = g.start[i];
        TORCH_CHECK(st[i][kKeys].device() == query.device(), op, ": tables[", i, "] must be on the device of query (",
                    query.device(), "), got ", st[i][kKeys].device());
        g.t[i] = st[i].c.t;
        tf_dynemb_probe &p = g.p[i];
        p = tf_dynemb_probe{};
        p.n = g.start[i + 1] - s;
        p.query = query.data_ptr<int64_t>() + s;
        p.slots = g.slots.data_ptr<int64_t>() + s;
        p.epoch = static_cast<int32_t>(epochs[i]);
        if (insert) {
            p.allow_evict = allow_evict[i];
            p.is_new = g.is_new.data_ptr<uint8_t>() + s;
            p.evicted_keys = g.ev_keys.data_ptr<int64_t>() + s;
            p.evicted_slots = g.ev_slots.data_ptr<int64_t>() + s;
            p.evicted_scores = g.ev_scores.data_ptr<int64_t>() + s;
            p.counts = g.counts.data_ptr<int64_t>() + 3 * i;
        }
    }
    return g;
}

std::vector<tf_dynemb_init_params> prepare_tables_init(const at::Tensor &slots, const at::Tensor &keys,
                                                       const std::optional<at::Tensor> &mask,
                                                       const std::vector<int64_t> &start,
                                                       const std::vector<DynembState> &st, at::IntArrayRef init_kinds,
                                                       at::ArrayRef<double> a, at::ArrayRef<double> b,
                                                       at::IntArrayRef seeds) {
    const char *op = "torchfuse.dynemb_tables_init";
    const size_t T = st.size();
    for (auto [got, arg] : {std::pair<size_t, const char *>{init_kinds.size(), "init_kinds"}, {a.size(), "a"}, {b.size(), "b"},
                            {seeds.size(), "seeds"}})
        check_count(got, T, op, arg);
    TORCH_CHECK(keys.numel() == slots.numel(), op, ": keys and slots must have the same length");
    TORCH_CHECK(!mask.has_value() || mask->numel() == slots.numel(), op, ": mask must have one entry per slot");
    // Built against the whole batch (the same checks), then pointed at table i's part: no per-table
    // tensor views (their dispatcher calls were most of a batched op's host time).
    std::vector<tf_dynemb_init_params> p(T);
    for (size_t i = 0; i < T; ++i) {
        p[i] = dynemb_init_params(slots, keys, mask, st[i], init_kinds[i], a[i], b[i], seeds[i], op);
        p[i].n = start[i + 1] - start[i];
        p[i].slots += start[i];
        p[i].keys += start[i];
        if (p[i].mask) p[i].mask += start[i];
    }
    return p;
}

std::vector<tf_dynemb_update_params> prepare_tables_update(const at::Tensor &slots, const at::Tensor &grad,
                                                           const std::vector<int64_t> &start,
                                                           const std::vector<DynembState> &st, int64_t opt, double lr,
                                                           double eps, double beta1, double beta2,
                                                           at::ArrayRef<double> step_sizes) {
    const char *op = "torchfuse.dynemb_tables_update";
    const size_t T = st.size();
    check_count(step_sizes.size(), T, op, "step_sizes");
    TORCH_CHECK(grad.dim() == 2 && grad.size(0) == slots.numel(), op, ": grad must have one row per slot (",
                slots.numel(), "), got ", grad.sizes());
    std::vector<tf_dynemb_update_params> p(T);
    for (size_t i = 0; i < T; ++i) {  // whole-batch params pointed at table i's part, as in init
        p[i] = dynemb_update_params(slots, &grad, st[i], opt, lr, eps, beta1, beta2, step_sizes[i], op);
        p[i].n = start[i + 1] - start[i];
        p[i].slots += start[i];
        p[i].grad = static_cast<const char *>(p[i].grad) + start[i] * p[i].grad_stride * grad.element_size();
    }
    return p;
}

DynembTablesPool prepare_tables_pool(const at::Tensor &slots, const at::Tensor &offsets,
                                     const std::optional<at::Tensor> &weights, int64_t batch, at::IntArrayRef features,
                                     const std::vector<DynembState> &st, const std::vector<bool> &mean) {
    const char *op = "torchfuse.dynemb_tables_pool";
    const size_t T = st.size();
    check_count(features.size(), T, op, "features");
    check_count(mean.size(), T, op, "mean");
    TORCH_CHECK(batch >= 0, op, ": batch must be >= 0, got ", batch);
    const at::Tensor &rows0 = st[0][kValues];
    check_index(slots, rows0, op, "slots");
    check_index(offsets, rows0, op, "offsets");
    DynembTablesPool g;
    g.start.assign(T + 1, 0);
    int64_t cols = 0;
    for (size_t i = 0; i < T; ++i) {
        TORCH_CHECK(features[i] >= 0, op, ": features must be >= 0, got ", features);
        TORCH_CHECK(st[i][kValues].device() == rows0.device(), op, ": tables[", i,
                    "] must be on the device of tables[0] (", rows0.device(), "), got ", st[i][kValues].device());
        g.start[i + 1] = g.start[i] + features[i] * batch;
        cols += features[i] * st[i].c.dim;
    }
    TORCH_CHECK(offsets.numel() == g.start[T] + 1, op, ": offsets must hold sum(features) * batch + 1 = ",
                g.start[T] + 1, " entries, got ", offsets.numel());
    const float *w = nullptr;
    if (weights.has_value()) {
        TORCH_CHECK(weights->scalar_type() == at::kFloat && weights->numel() == slots.numel() &&
                        weights->is_contiguous(),
                    op, ": weights must be contiguous float32 with one entry per id");
        check_same_device(*weights, rows0, op, "weights", "the tables");
        w = weights->data_ptr<float>();
    }
    g.out = at::empty({batch, cols}, rows0.options().dtype(at::kFloat));
    g.p.resize(T);
    int64_t col = 0;
    for (size_t i = 0; i < T; ++i) {
        tf_dynemb_pool_params &p = g.p[i];
        p = tf_dynemb_pool_params{};
        p.n_bags = g.start[i + 1] - g.start[i];
        p.slots = slots.data_ptr<int64_t>();
        p.n_ids = slots.numel();
        p.offsets = offsets.data_ptr<int64_t>() + g.start[i];
        p.weights = w;
        p.mean = mean[i];
        p.values = st[i].c.values;
        p.dtype = st[i].c.dtype;
        p.dim = st[i].c.dim;
        p.out = g.out.data_ptr<float>() + col;
        p.out_dtype = TF_F32;
        p.out_block_bags = batch > 0 ? batch : 1;
        p.out_row_stride = cols;
        col += features[i] * p.dim;
    }
    return g;
}

void check_tables_touch(const std::vector<DynembState> &st, const at::Tensor &slots, at::IntArrayRef policies,
                        at::IntArrayRef clocks) {
    const char *op = "torchfuse.dynemb_tables_touch";
    const size_t T = st.size();
    check_count(policies.size(), T, op, "policies");
    check_count(clocks.size(), T, op, "clocks");
    for (size_t i = 0; i < T; ++i) {
        TORCH_CHECK(st[i][kKeys].device() == slots.device(), op, ": tables[", i, "] must be on the device of slots (",
                    slots.device(), "), got ", st[i][kKeys].device());
        TORCH_CHECK(policies[i] == TF_DYNEMB_LRU || policies[i] == TF_DYNEMB_LFU, op, ": bad policy ", policies[i]);
    }
    check_index(slots, st[0][kKeys], op, "slots");
}

namespace {

at::Tensor tables_lookup_cpu(const at::Tensor &query, at::IntArrayRef starts, at::TensorList tables,
                             at::IntArrayRef epochs) {
    DynembTablesProbe g = prepare_tables_probe(false, query, nullptr, starts,
                                               dynemb_states(tables, "torchfuse.dynemb_tables_lookup"), epochs, {});
    for (size_t i = 0; i < g.t.size(); ++i)
        at::parallel_for(0, g.p[i].n, 2048, [&](int64_t b, int64_t e) { tf_dynemb_lookup_cpu(&g.t[i], &g.p[i], b, e); });
    return g.slots;
}

DynembInsertResult tables_insert_cpu(const at::Tensor &query, at::Tensor &slots, at::IntArrayRef starts,
                                     at::TensorList tables, at::IntArrayRef epochs, const c10::List<bool> &allow_evict) {
    DynembTablesProbe g = prepare_tables_probe(true, query, &slots, starts,
                                               dynemb_states(tables, "torchfuse.dynemb_tables_insert"), epochs,
                                               allow_evict.vec());
    for (size_t i = 0; i < g.t.size(); ++i) tf_dynemb_insert_cpu(&g.t[i], &g.p[i]);
    return g.result();
}

void tables_init_cpu(const at::Tensor &slots, const at::Tensor &keys, const std::optional<at::Tensor> &mask,
                     at::IntArrayRef starts, at::TensorList tables, at::IntArrayRef init_kinds, at::ArrayRef<double> a,
                     at::ArrayRef<double> b, at::IntArrayRef seeds) {
    const char *op = "torchfuse.dynemb_tables_init";
    const auto st = dynemb_states(tables, op);
    const auto start = tables_starts(starts, slots.numel(), st.size(), op);
    for (auto &p : prepare_tables_init(slots, keys, mask, start, st, init_kinds, a, b, seeds))
        at::parallel_for(0, p.n, 64, [&](int64_t b0, int64_t e0) { tf_dynemb_init_cpu(&p, b0, e0); });
}

void tables_touch_cpu(at::TensorList tables, const at::Tensor &slots, at::IntArrayRef starts, at::IntArrayRef policies,
                      at::IntArrayRef clocks) {
    const char *op = "torchfuse.dynemb_tables_touch";
    const auto st = dynemb_states(tables, op);
    const auto start = tables_starts(starts, slots.numel(), st.size(), op);
    check_tables_touch(st, slots, policies, clocks);
    for (size_t i = 0; i < st.size(); ++i)
        tf_dynemb_touch_cpu(st[i].c.t.scores, slots.data_ptr<int64_t>() + start[i], start[i + 1] - start[i],
                            (int)policies[i], clocks[i]);
}

void tables_update_cpu(const at::Tensor &slots, const at::Tensor &grad, at::IntArrayRef starts, at::TensorList tables,
                       int64_t opt, double lr, double eps, double beta1, double beta2, at::ArrayRef<double> step_sizes) {
    const char *op = "torchfuse.dynemb_tables_update";
    const auto st = dynemb_states(tables, op);
    const auto start = tables_starts(starts, slots.numel(), st.size(), op);
    for (auto &p : prepare_tables_update(slots, grad, start, st, opt, lr, eps, beta1, beta2, step_sizes))
        at::parallel_for(0, p.n, 64, [&](int64_t b0, int64_t e0) { tf_dynemb_update_cpu(&p, b0, e0); });
}

at::Tensor tables_pool_cpu(const at::Tensor &slots, const at::Tensor &offsets, const std::optional<at::Tensor> &weights,
                           int64_t batch, at::IntArrayRef features, at::TensorList tables, const c10::List<bool> &mean) {
    DynembTablesPool g = prepare_tables_pool(slots, offsets, weights, batch, features,
                                             dynemb_states(tables, "torchfuse.dynemb_tables_pool"), mean.vec());
    for (auto &p : g.p) at::parallel_for(0, p.n_bags, 16, [&](int64_t b, int64_t e) { tf_dynemb_pool_cpu(&p, b, e); });
    return g.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
    m.impl("dynemb_tables_lookup", &tables_lookup_cpu);
    m.impl("dynemb_tables_insert", &tables_insert_cpu);
    m.impl("dynemb_tables_init", &tables_init_cpu);
    m.impl("dynemb_tables_touch", &tables_touch_cpu);
    m.impl("dynemb_tables_update", &tables_update_cpu);
    m.impl("dynemb_tables_pool", &tables_pool_cpu);
}

}  // namespace torchfuse
