// Dynamic embedding table ops: argument checks and kernel-parameter setup shared by the CPU
// (dynemb.cpp) and CUDA (dynemb_cuda.cpp) implementations (schemas: registration.cpp). The table's
// state is a set of tensors owned by the Python module (python/torchfuse/dynamic_embedding.py).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <tuple>

#include "../kernels/dynemb_kernels.h"

namespace torchfuse {

using DynembInsertResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// An insert's kernel parameters and the outputs they point into: (is_new, evicted keys, evicted
// slots, evicted scores, counts), each its own tensor (the schema promises outputs that do not alias
// one another; torch.compile relies on it). Shared by the CPU and CUDA implementations.
struct DynembInsert {
    tf_dynemb_table t;
    tf_dynemb_probe p;
    at::Tensor is_new, ev_keys, ev_slots, ev_scores, counts;
    DynembInsertResult result() const { return {is_new, ev_keys, ev_slots, ev_scores, counts}; }
};
DynembInsert prepare_dynemb_insert(const at::Tensor &query, at::Tensor &slots, at::Tensor &keys, at::Tensor &digests,
                                   at::Tensor &scores, at::Tensor &marks, at::Tensor *locks, int64_t bucket_size,
                                   int64_t epoch, bool allow_evict, bool filled = true);

// keys/digests/scores/marks/locks checked against each other and against the queried keys.
tf_dynemb_table dynemb_table(const at::Tensor &query, const at::Tensor &keys, const at::Tensor &digests,
                             const at::Tensor *scores, const at::Tensor &marks, const at::Tensor *locks,
                             int64_t bucket_size, const char *op);
// A 1-D int64 contiguous tensor of keys or slots on `ref`'s device.
void check_index(const at::Tensor &t, const at::Tensor &ref, const char *op, const char *arg);
// The optional visiting order of dynemb_gather / dynemb_scatter: int64, 1-D, contiguous, as many
// entries as slots, on slots' device. Its data (NULL when absent: batch order).
const int64_t *dynemb_order(const std::optional<at::Tensor> &order, const at::Tensor &slots, const char *op);
// Two-tier rows: `rows` (n_hbm, width...) on the table's device, `rows_host` the rest with the same
// row shape and dtype (pinned host memory for a CUDA table). host pointer filled by the caller.
tf_dynemb_rows dynemb_rows(const at::Tensor &rows, const at::Tensor &rows_host, const at::Tensor &ref,
                           const char *op, const char *arg);
// Trailing row shape of `rows` (everything after dim 0).
std::vector<int64_t> row_shape(const at::Tensor &rows, int64_t n);

tf_dynemb_init_params dynemb_init_params(const at::Tensor &slots, const at::Tensor &keys,
                                         const std::optional<at::Tensor> &mask, const at::Tensor &values,
                                         const at::Tensor &values_host, const at::Tensor &state,
                                         const at::Tensor &state_host, int64_t init_kind, double a, double b,
                                         int64_t seed, const char *op = "torchfuse.dynemb_init",
                                         const char *mask_arg = "mask");
// dynemb_init_gather's checks and parameters (mask = is_new, required); out (n, dim) is allocated
// here; *ord is order's data (NULL: batch order).
tf_dynemb_init_params dynemb_init_gather_params(const at::Tensor &slots, const at::Tensor &keys,
                                                const at::Tensor &is_new, const at::Tensor &values,
                                                const at::Tensor &values_host, const at::Tensor &state,
                                                const at::Tensor &state_host, int64_t init_kind, double a, double b,
                                                int64_t seed, const std::optional<at::Tensor> &order,
                                                const int64_t **ord, at::Tensor &out);
tf_dynemb_update_params dynemb_update_params(const at::Tensor &slots, const at::Tensor *grad, const at::Tensor &values,
                                             const at::Tensor &values_host, const at::Tensor &state,
                                             const at::Tensor &state_host, int64_t opt, double lr, double eps,
                                             double beta1, double beta2, double step_size);

tf_dynemb_pool_params dynemb_pool_params(const at::Tensor &slots, const at::Tensor &offsets,
                                         const std::optional<at::Tensor> &weights, const at::Tensor &rows,
                                         const at::Tensor &rows_host, bool mean, at::Tensor &out,
                                         const std::optional<at::Tensor> &inv = std::nullopt);
tf_dynemb_segsum_params dynemb_segsum_params(const at::Tensor &grad, const at::Tensor &perm, const at::Tensor &seg,
                                             const std::optional<at::Tensor> &bag_of,
                                             const std::optional<at::Tensor> &scale, at::Tensor *out);

// find-or-insert with the row work folded in: parameters and outputs (shared by CPU and CUDA). The
// four evicted arrays are the rows of one (4, n) int64 tensor (keys, slots, scores, new index): one
// allocation ahead of the first launch and one free after the caller's host sync, not four of each.
using DynembFoiResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
struct DynembFoi {
    tf_dynemb_table t;
    tf_dynemb_foi_params p;
    at::Tensor slots, rows, is_new, evicted, counts;
    DynembFoiResult result() const { return {slots, rows, is_new, evicted, counts}; }
};
// The eviction row work's checks and parameters (tf_dynemb_evict_params); old_values / old_state are
// allocated here.
tf_dynemb_evict_params dynemb_evict_params(const at::Tensor &slots, const at::Tensor &new_index, const at::Tensor &keys,
                                           const at::Tensor &values, const at::Tensor &values_host,
                                           const at::Tensor &state, const at::Tensor &state_host, at::Tensor &rows,
                                           int64_t init_kind, double a, double b, int64_t seed, at::Tensor &old_values,
                                           at::Tensor &old_state);
DynembFoi prepare_find_or_insert(const at::Tensor &query, at::Tensor &keys, at::Tensor &digests, at::Tensor &scores,
                                 at::Tensor &marks, at::Tensor *locks, at::Tensor &values, at::Tensor &values_host,
                                 at::Tensor &state, at::Tensor &state_host, int64_t bucket_size, int64_t epoch,
                                 bool allow_evict, int64_t policy, int64_t clock, int64_t init_kind, double a,
                                 double b, int64_t seed, bool with_rows, bool filled = true,
                                 bool evicted_list = true);

// dynemb_find_or_insert_sync: find_or_insert, the host's wait for its counts, and the eviction row
// work, in one op (what a find_or_insert call must finish before it returns, without the Python of a
// second op and two clones per call): (slots, rows, is_new, evicted (4, n_evicted): the victims' keys,
// slots, scores and the new keys' indices; the victims' values and state; the counts (inserted,
// n_evicted, failed, keys taken, aborted) as a CPU tensor: an op's int outputs would be
// data-dependent symbols to tracing). With n_valid, only the first n_valid[0] keys are taken and the
// outputs hold that many; with abort set, none (the table untouched).
using DynembFoiSyncResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// DynembFoiSyncResult and the batch's bags pooled (dynemb_find_or_insert_pool).
using DynembFoiPoolResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// The part after the host has the counts c (inserted, evicted, failed): evict_rows(slots, new_index,
// rows) is the device's eviction row work on the table (victims' rows and state out, new rows in).
// slot_order (a table with host rows): the evictions are sorted by victim slot first, so the row work
// visits the victims in slot order (host rows in address order: random host addresses thrash the
// GPU's translation of host pages); the record (keys, slots, scores, new indices and the victims'
// rows and state) then comes out in that order, its entries consistent with one another. Pure-HBM
// tables keep the list's own order (no sort).
inline bool dynemb_slot_order(const at::Tensor &values_host, const at::Tensor &state_host) {
    return values_host.numel() > 0 || state_host.numel() > 0;
}
// dynemb_find_or_insert_sync's optional n_valid (how many of the query's keys to take, int64, one
// element) and abort (a bool / uint8 flag: take none) on the table's device, checked; their data
// pointers, or NULL.
struct DynembFoiLimits {
    const int64_t *n_valid = nullptr;
    const uint8_t *abort = nullptr;
};
DynembFoiLimits dynemb_foi_limits(const at::Tensor &query, const at::Tensor &keys, const std::optional<at::Tensor> &n_valid,
                                  const std::optional<at::Tensor> &abort);
// The outputs narrowed to the keys taken (c[3]; none when aborted, c[4]).
inline DynembFoiResult narrow_foi(const DynembFoiResult &r, const int64_t (&c)[5]) {
    const auto &[slots, rows, is_new, evicted, counts] = r;
    const int64_t n = c[4] ? 0 : c[3];
    if (n == slots.numel()) return r;
    return {slots.narrow(0, 0, n), rows.size(0) ? rows.narrow(0, 0, n) : rows, is_new.narrow(0, 0, n), evicted, counts};
}
// c: (inserted, evicted, failed, keys taken, aborted), returned as the op's CPU counts. keep: the
// victims' rows are saved (evict_rows) before the evicting keys' rows are written; !keep: the kernels
// wrote those rows (tf_dynemb_foi_params.keep_victims = 0); the list and the victims' values and state
// come back empty (the counts still say how many keys were evicted).
template <typename EvictRows>
DynembFoiSyncResult finish_find_or_insert(const DynembFoiResult &r, const int64_t (&c)[5], const at::Tensor &values,
                                          const at::Tensor &state, bool slot_order, bool keep, EvictRows evict_rows) {
    const auto &[slots, rows, is_new, evicted, counts] = r;
    const int64_t n_ev = c[4] ? 0 : c[1];
    at::Tensor host = at::empty({5}, evicted.options().device(at::kCPU));
    std::copy(c, c + 5, host.data_ptr<int64_t>());
    if (n_ev == 0 || !keep)
        return {slots, rows, is_new, at::empty({4, 0}, evicted.options()), at::empty({0, values.size(1)}, values.options()),
                at::empty({0, state.size(1)}, state.options()), host};
    // its own storage: the (4, n) buffer is freed now
    at::Tensor ev = evicted.narrow(1, 0, n_ev);
    ev = slot_order && n_ev > 1 ? ev.index_select(1, at::argsort(ev.select(0, 1))).contiguous() : ev.clone();
    at::Tensor rows_out = rows;
    auto [old_values, old_state] = evict_rows(ev.select(0, 1), ev.select(0, 3), rows_out);
    return {slots, rows, is_new, ev, old_values, old_state, host};
}

// ---- table-batched ops (dynemb_tables.cpp): per-table kernel parameters over a concatenated batch ----

// starts checked: tables + 1 non-decreasing entries from 0 to n_items.
std::vector<int64_t> tables_starts(at::IntArrayRef starts, int64_t n_items, size_t tables, const char *op);

struct DynembTablesProbe {
    std::vector<int64_t> start;
    std::vector<tf_dynemb_table> t;
    std::vector<tf_dynemb_probe> p;
    at::Tensor slots, is_new, ev_keys, ev_slots, ev_scores, counts;
    DynembInsertResult result() const { return {is_new, ev_keys, ev_slots, ev_scores, counts}; }
};
// lookup: slots allocated; insert (slots given, locks may be empty on CPU): the outputs allocated.
DynembTablesProbe prepare_tables_probe(bool insert, const at::Tensor &query, const at::Tensor *slots,
                                       at::IntArrayRef starts, at::TensorList keys, at::TensorList digests,
                                       at::TensorList scores, at::TensorList marks, at::TensorList locks,
                                       at::IntArrayRef bucket_sizes, at::IntArrayRef epochs,
                                       const std::vector<bool> &allow_evict);
std::vector<tf_dynemb_init_params> prepare_tables_init(const at::Tensor &slots, const at::Tensor &keys,
                                                       const std::optional<at::Tensor> &mask,
                                                       const std::vector<int64_t> &start, at::TensorList values,
                                                       at::TensorList values_host, at::TensorList state,
                                                       at::TensorList state_host, at::IntArrayRef init_kinds,
                                                       at::ArrayRef<double> a, at::ArrayRef<double> b,
                                                       at::IntArrayRef seeds);
std::vector<tf_dynemb_update_params> prepare_tables_update(const at::Tensor &slots, const at::Tensor &grad,
                                                           const std::vector<int64_t> &start, at::TensorList values,
                                                           at::TensorList values_host, at::TensorList state,
                                                           at::TensorList state_host, int64_t opt, double lr,
                                                           double eps, double beta1, double beta2,
                                                           at::ArrayRef<double> step_sizes);
struct DynembTablesPool {
    std::vector<int64_t> start;  // bag starts
    std::vector<tf_dynemb_pool_params> p;
    at::Tensor out;
};
DynembTablesPool prepare_tables_pool(const at::Tensor &slots, const at::Tensor &offsets,
                                     const std::optional<at::Tensor> &weights, int64_t batch, at::IntArrayRef features,
                                     at::TensorList rows, at::TensorList rows_host, const std::vector<bool> &mean);
void check_tables_touch(at::TensorList scores, const at::Tensor &slots, at::IntArrayRef policies,
                        at::IntArrayRef clocks, const std::vector<int64_t> &start);

}  // namespace torchfuse
