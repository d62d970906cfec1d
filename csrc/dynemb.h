// Dynamic embedding table ops: argument checks and kernel-parameter setup shared by the CPU
// (dynemb.cpp) and CUDA (dynemb_cuda.cpp) implementations (schemas: registration.cpp). The table's
// state is a set of tensors owned by the Python table (python/torchfuse/dynamic_embedding/_table.py);
// it crosses the op boundary as one list, `table`, in DynembField order, and dynemb_state checks and
// unpacks it into one tf_dynemb_state.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <tuple>

#include "../kernels/dynemb_kernels.h"

namespace torchfuse {

using DynembInsertResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The entries of an op's `table` list (the Python side names the same order in _table.py's
// STATE_FIELDS). A table-batched op takes the lists of its tables one after another (`tables`,
// kDynembFields entries per table).
enum DynembField : int {
    kKeys = 0,    // int64 (capacity): the slots' keys
    kDigests,     // uint8 (capacity): 0 = empty slot
    kScores,      // int64 (capacity): LRU clock / LFU count
    kMarks,       // int32 (capacity): epoch of the last operation that touched the slot
    kLocks,       // int32 (capacity / bucket_size): per-bucket locks; its length gives the bucket size
    kValues,      // (n_hbm, dim) rows on the table's device
    kValuesHost,  // (capacity - n_hbm, dim) rows in (mapped, pinned) host memory
    kState,       // float32 (n_hbm, state_dim) optimizer state
    kStateHost,   // float32 (capacity - n_hbm, state_dim)
    kDynembFields
};
extern const char *const kDynembFieldNames[kDynembFields];

// A checked table: its tensors (entries of the op's list) and their C view.
struct DynembState {
    const at::Tensor *f;  // kDynembFields tensors
    tf_dynemb_state c;
    const at::Tensor &operator[](int i) const { return f[i]; }
    int64_t capacity() const { return f[kKeys].numel(); }
    int64_t bucket_size() const { return c.t.bucket_size; }
    // rows in host memory: row copies on a CUDA table visit them in slot order
    bool has_host_rows() const { return f[kValuesHost].numel() > 0 || f[kStateHost].numel() > 0; }
};
// Checks table[0 .. kDynembFields) (every entry, and that they agree with one another) and returns
// the state. arg names the list in errors ("table", or "tables" with index t: "tables[t][f] (name)").
DynembState dynemb_state(at::TensorList table, const char *op, const char *arg = "table", int64_t index = -1);
// A table-batched op's `tables`: kDynembFields entries per table, at least one table.
std::vector<DynembState> dynemb_states(at::TensorList tables, const char *op);

// An insert's kernel parameters and the outputs they point into: (is_new, evicted keys, evicted
// slots, evicted scores, counts), each its own tensor (the schema promises outputs that do not alias
// one another; torch.compile relies on it). Shared by the CPU and CUDA implementations.
struct DynembInsert {
    tf_dynemb_table t;
    tf_dynemb_probe p;
    at::Tensor is_new, ev_keys, ev_slots, ev_scores, counts;
    DynembInsertResult result() const { return {is_new, ev_keys, ev_slots, ev_scores, counts}; }
};
DynembInsert prepare_dynemb_insert(const at::Tensor &query, at::Tensor &slots, const DynembState &st, int64_t epoch,
                                   bool allow_evict, bool filled = true);
// A 1-D int64 contiguous tensor of keys or slots on `ref`'s device.
void check_index(const at::Tensor &t, const at::Tensor &ref, const char *op, const char *arg);
// The optional visiting order of dynemb_gather / dynemb_scatter: int64, 1-D, contiguous, as many
// entries as slots, on slots' device. Its data (NULL when absent: batch order).
const int64_t *dynemb_order(const std::optional<at::Tensor> &order, const at::Tensor &slots, const char *op);
// Two-tier rows: `rows` (n_hbm, width...) on the table's device, `rows_host` the rest with the same
// row shape and dtype (pinned host memory for a CUDA table). host pointer filled by the caller.
tf_dynemb_rows dynemb_rows(const at::Tensor &rows, const at::Tensor &rows_host, const at::Tensor &ref,
                           const char *op, const char *arg);
// dynemb_gather / dynemb_scatter's checked arguments: the rows (host pointer filled by the caller)
// and the visiting order (NULL: batch order).
struct DynembRowCopy {
    tf_dynemb_rows r;
    const int64_t *order;
};
DynembRowCopy dynemb_row_copy(const at::Tensor &slots, const at::Tensor &rows, const at::Tensor &rows_host,
                              const std::optional<at::Tensor> &order, const char *op);
// dynemb_scatter's src checked against slots and rows; contiguous.
at::Tensor dynemb_scatter_src(const at::Tensor &src, const at::Tensor &slots, const at::Tensor &rows);
// Trailing row shape of `rows` (everything after dim 0).
std::vector<int64_t> row_shape(const at::Tensor &rows, int64_t n);

tf_dynemb_init_params dynemb_init_params(const at::Tensor &slots, const at::Tensor &keys,
                                         const std::optional<at::Tensor> &mask, const DynembState &st,
                                         int64_t init_kind, double a, double b, int64_t seed,
                                         const char *op = "torchfuse.dynemb_init", const char *mask_arg = "mask");
// dynemb_init_gather's checks and parameters (mask = is_new, required); out (n, dim) is allocated
// here; *ord is order's data (NULL: batch order).
tf_dynemb_init_params dynemb_init_gather_params(const at::Tensor &slots, const at::Tensor &keys,
                                                const at::Tensor &is_new, const DynembState &st, int64_t init_kind,
                                                double a, double b, int64_t seed, const std::optional<at::Tensor> &order,
                                                const int64_t **ord, at::Tensor &out);
tf_dynemb_update_params dynemb_update_params(const at::Tensor &slots, const at::Tensor *grad, const DynembState &st,
                                             int64_t opt, double lr, double eps, double beta1, double beta2,
                                             double step_size, const char *op = "torchfuse.dynemb_update");

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
                                           const DynembState &st, at::Tensor &rows, int64_t init_kind, double a,
                                           double b, int64_t seed, at::Tensor &old_values, at::Tensor &old_state);
// The find-or-insert ops' scalars (schema order after `table`).
struct DynembFoiArgs {
    int64_t epoch;
    bool allow_evict;
    int64_t policy, clock, init_kind;
    double a, b;
    int64_t seed;
    bool with_rows;
};
DynembFoi prepare_find_or_insert(const at::Tensor &query, const DynembState &st, const DynembFoiArgs &args,
                                 bool filled = true, bool evicted_list = true);

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
// dynemb_find_or_insert_sync's optional n_valid (how many of the query's keys to take, int64, one
// element) and abort (a bool / uint8 flag: take none) on the table's device, checked; their data
// pointers, or NULL.
struct DynembFoiLimits {
    const int64_t *n_valid = nullptr;
    const uint8_t *abort = nullptr;
};
DynembFoiLimits dynemb_foi_limits(const DynembState &st, const std::optional<at::Tensor> &n_valid,
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
DynembFoiSyncResult finish_find_or_insert(const DynembFoiResult &r, const int64_t (&c)[5], const DynembState &st,
                                          bool keep, EvictRows evict_rows) {
    const auto &[slots, rows, is_new, evicted, counts] = r;
    const at::Tensor &values = st[kValues], &state = st[kState];
    const bool slot_order = st.has_host_rows();
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
                                       at::IntArrayRef starts, const std::vector<DynembState> &st,
                                       at::IntArrayRef epochs, const std::vector<bool> &allow_evict);
std::vector<tf_dynemb_init_params> prepare_tables_init(const at::Tensor &slots, const at::Tensor &keys,
                                                       const std::optional<at::Tensor> &mask,
                                                       const std::vector<int64_t> &start,
                                                       const std::vector<DynembState> &st, at::IntArrayRef init_kinds,
                                                       at::ArrayRef<double> a, at::ArrayRef<double> b,
                                                       at::IntArrayRef seeds);
std::vector<tf_dynemb_update_params> prepare_tables_update(const at::Tensor &slots, const at::Tensor &grad,
                                                           const std::vector<int64_t> &start,
                                                           const std::vector<DynembState> &st, int64_t opt, double lr,
                                                           double eps, double beta1, double beta2,
                                                           at::ArrayRef<double> step_sizes);
struct DynembTablesPool {
    std::vector<int64_t> start;  // bag starts
    std::vector<tf_dynemb_pool_params> p;
    at::Tensor out;
};
DynembTablesPool prepare_tables_pool(const at::Tensor &slots, const at::Tensor &offsets,
                                     const std::optional<at::Tensor> &weights, int64_t batch, at::IntArrayRef features,
                                     const std::vector<DynembState> &st, const std::vector<bool> &mean);
void check_tables_touch(const std::vector<DynembState> &st, const at::Tensor &slots, at::IntArrayRef policies,
                        at::IntArrayRef clocks);

}  // namespace torchfuse
