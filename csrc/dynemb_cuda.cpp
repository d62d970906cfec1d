// Dynamic embedding table ops: the CUDA implementation (checks and setup live in dynemb.cpp).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <atomic>
#include <functional>
#include <unordered_map>

#include "dynemb.h"
#include "dynemb_ops.h"
#include "tf_check.h"

namespace torchfuse {
namespace {

void check_launch(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void *stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// The device address of the host tier (pinned, mapped host memory: kernels read it over PCIe).
void map_host(tf_dynemb_rows &r, const at::Tensor &rows_host) {
    if (!r.host || rows_host.is_cuda()) return;
    void *dev = nullptr;
    const cudaError_t e = cudaHostGetDevicePointer(&dev, rows_host.data_ptr(), 0);
    TORCH_CHECK(e == cudaSuccess, "torchfuse.dynemb: host rows are not mapped pinned memory: ", cudaGetErrorString(e));
    r.host = static_cast<char *>(dev);
}

// A table's state with its host tiers' device addresses.
DynembState cuda_state(at::TensorList table, const char *op) {
    DynembState st = dynemb_state(table, op);
    map_host(st.c.values, st[kValuesHost]);
    map_host(st.c.state, st[kStateHost]);
    return st;
}

// The CUDA kernel runners (dynemb_ops.h) on the current stream.
struct DynembCuda {
    using Guard = c10::cuda::CUDAGuard;
    static DynembState row_state(at::TensorList table, const char *op) { return cuda_state(table, op); }
    static void lookup(const tf_dynemb_table &t, const tf_dynemb_probe &p) {
        check_launch(tf_dynemb_lookup_cuda(&t, &p, stream()), "dynemb lookup kernel");
    }
    static void insert(const tf_dynemb_table &t, const tf_dynemb_probe &p) {
        check_launch(tf_dynemb_insert_cuda(&t, &p, stream()), "dynemb insert kernel");
    }
    static void touch(int64_t *scores, const int64_t *slots, int64_t n, int policy, int64_t clock) {
        check_launch(tf_dynemb_touch_cuda(scores, slots, n, policy, clock, stream()), "dynemb touch kernel");
    }
    static void init(const tf_dynemb_init_params &p) {
        check_launch(tf_dynemb_init_cuda(&p, stream()), "dynemb init kernel");
    }
    static void init_gather(const tf_dynemb_init_params &p, const int64_t *ord, void *out) {
        check_launch(tf_dynemb_init_gather_cuda(&p, ord, out, stream()), "dynemb init-gather kernel");
    }
    static void evict_rows(const tf_dynemb_evict_params &p) {
        check_launch(tf_dynemb_evict_rows_cuda(&p, stream()), "dynemb evict-rows kernel");
    }
    static void update(const tf_dynemb_update_params &p) {
        check_launch(tf_dynemb_update_cuda(&p, stream()), "dynemb update kernel");
    }
};
using CudaOps = DynembOps<DynembCuda>;

std::tuple<at::Tensor, at::Tensor> find_cuda(const at::Tensor &query, at::TensorList table) {
    const char *op = "torchfuse.dynemb_find";
    const DynembState st = cuda_state(table, op);
    const c10::cuda::CUDAGuard guard(st[kKeys].device());
    check_index(query, st[kKeys], op, "query");
    at::Tensor slots = at::empty({query.numel()}, query.options());
    at::Tensor out = at::empty(row_shape(st[kValues], query.numel()), st[kValues].options());
    check_launch(tf_dynemb_find_cuda(&st.c.t, query.data_ptr<int64_t>(), query.numel(), slots.data_ptr<int64_t>(),
                                     &st.c.values, out.data_ptr(), stream()),
                 "dynemb find kernel");
    return {out, slots};
}

at::Tensor gather_cuda(const at::Tensor &slots, const at::Tensor &rows, const at::Tensor &rows_host,
                       const std::optional<at::Tensor> &order) {
    const c10::cuda::CUDAGuard guard(rows.device());
    DynembRowCopy c = dynemb_row_copy(slots, rows, rows_host, order, "torchfuse.dynemb_gather");
    map_host(c.r, rows_host);
    at::Tensor out = at::empty(row_shape(rows, slots.numel()), rows.options());
    check_launch(tf_dynemb_gather_cuda(&c.r, slots.data_ptr<int64_t>(), c.order, slots.numel(), out.data_ptr(),
                                       stream()),
                 "dynemb gather kernel");
    return out;
}

void scatter_cuda(const at::Tensor &slots, const at::Tensor &src, at::Tensor &rows, at::Tensor &rows_host,
                  const std::optional<at::Tensor> &order) {
    const c10::cuda::CUDAGuard guard(rows.device());
    DynembRowCopy c = dynemb_row_copy(slots, rows, rows_host, order, "torchfuse.dynemb_scatter");
    map_host(c.r, rows_host);
    const at::Tensor s = dynemb_scatter_src(src, slots, rows);
    check_launch(tf_dynemb_scatter_cuda(&c.r, slots.data_ptr<int64_t>(), c.order, slots.numel(), s.data_ptr(),
                                        stream()),
                 "dynemb scatter kernel");
}

at::Tensor host_rows_cuda(const at::Tensor &like, int64_t rows, int64_t cols, at::ScalarType dtype) {
    const c10::cuda::CUDAGuard guard(like.device());
    TORCH_CHECK(rows >= 0 && cols >= 0, "torchfuse.dynemb_host_rows: rows and cols must be >= 0");
    const at::TensorOptions o = at::TensorOptions().dtype(dtype).device(at::kCPU);
    const size_t bytes = static_cast<size_t>(rows * cols) * c10::elementSize(dtype);
    if (bytes == 0) return at::empty({rows, cols}, o);
    void *p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    TORCH_CHECK(e == cudaSuccess, "torchfuse.dynemb: cudaHostAlloc of ", bytes, " bytes failed: ", cudaGetErrorString(e));
    return at::from_blob(p, {rows, cols}, [](void *q) { cudaFreeHost(q); }, o);
}

at::Tensor pool_cuda(const at::Tensor &slots, const at::Tensor &offsets, const std::optional<at::Tensor> &weights,
                     const at::Tensor &rows, const at::Tensor &rows_host, bool mean, const std::optional<at::Tensor> &inv) {
    const c10::cuda::CUDAGuard guard(rows.device());
    at::Tensor out;
    tf_dynemb_pool_params p = dynemb_pool_params(slots, offsets, weights, rows, rows_host, mean, out, inv);
    map_host(p.values, rows_host);
    check_launch(tf_dynemb_pool_cuda(&p, stream()), "dynemb pool kernel");
    return out;
}

at::Tensor segsum_cuda(const at::Tensor &grad, const at::Tensor &perm, const at::Tensor &seg,
                       const std::optional<at::Tensor> &bag_of, const std::optional<at::Tensor> &scale) {
    const c10::cuda::CUDAGuard guard(grad.device());
    at::Tensor out;
    tf_dynemb_segsum_params p = dynemb_segsum_params(grad, perm, seg, bag_of, scale, &out);
    // scratch for the chunk sums of ids cut by a chunk edge (kernels/dynemb_kernels.h)
    const at::Tensor partial = at::empty({tf_dynemb_seg_partial_rows(p.n_occ), p.dim}, out.options());
    p.partial = partial.data_ptr<float>();
    check_launch(tf_dynemb_segsum_cuda(&p, stream()), "dynemb segment-sum kernel");
    return out;
}

void segment_update_cuda(const at::Tensor &grad, const at::Tensor &perm, const at::Tensor &seg,
                         const std::optional<at::Tensor> &bag_of, const std::optional<at::Tensor> &scale,
                         const at::Tensor &slots, at::TensorList table, int64_t opt, double lr, double eps,
                         double beta1, double beta2, double step_size) {
    const char *op = "torchfuse.dynemb_segment_update";
    const DynembState st = cuda_state(table, op);
    const c10::cuda::CUDAGuard guard(st[kKeys].device());
    if (st.c.dim > TF_DYNEMB_SEGSUM_UPDATE_MAX_DIM) {  // wide rows: the sums, then the update
        CudaOps::update_state(slots, segsum_cuda(grad, perm, seg, bag_of, scale), st, opt, lr, eps, beta1, beta2,
                              step_size);
        return;
    }
    tf_dynemb_segsum_params sp = dynemb_segsum_params(grad, perm, seg, bag_of, scale, nullptr);
    tf_dynemb_update_params up = dynemb_update_params(slots, nullptr, st, opt, lr, eps, beta1, beta2, step_size, op);
    TORCH_CHECK(slots.numel() == sp.n_unique, op, ": slots must have one entry per unique id (", sp.n_unique, "), got ",
                slots.numel());
    TORCH_CHECK(grad.size(1) == st.c.dim, op, ": grad must have ", st.c.dim, " columns, got ", grad.size(1));
    const at::Tensor partial = at::empty({tf_dynemb_seg_partial_rows(sp.n_occ), sp.dim}, grad.options().dtype(at::kFloat));
    sp.partial = partial.data_ptr<float>();
    check_launch(tf_dynemb_segsum_update_cuda(&sp, &up, stream()), "dynemb segment-sum + update kernels");
}

// n_valid, abort: tf_dynemb_foi_params' (device pointers or NULL)
// st: host tiers mapped (cuda_state)
DynembFoiResult launch_find_or_insert(const at::Tensor &query, const DynembState &st, const DynembFoiArgs &args,
                                      const int64_t *n_valid, const uint8_t *abort, bool keep_victims = true,
                                      int64_t *host_counts = nullptr, int64_t host_seq = 0) {
    const int64_t bucket_size = st.bucket_size();
    // 128-slot buckets: step 1 writes the outputs' defined contents itself (tf_dynemb_foi_params.fill_outputs)
    const bool kernel_fills = bucket_size == 128 && query.numel() > 0;
    DynembFoi f = prepare_find_or_insert(query, st, args, !kernel_fills, keep_victims || bucket_size != 128);
    f.p.fill_outputs = kernel_fills;
    f.p.keep_victims = keep_victims;
    f.p.host_counts = bucket_size == 128 ? host_counts : nullptr;
    f.p.host_seq = host_seq;
    f.p.n_valid = n_valid;
    f.p.abort = abort;
    at::Tensor miss;  // step 1's per-block lists of missed keys (128-slot buckets)
    if (bucket_size == 128) {
        TORCH_CHECK(query.numel() < (int64_t{1} << 31), "torchfuse.dynemb_find_or_insert_sync: at most 2^31 - 1 keys per call");
        miss = at::empty({tf_dynemb_foi_miss_bytes(query.numel())}, query.options().dtype(at::kByte));
        f.p.miss = miss.data_ptr<uint8_t>();
    }
    check_launch(tf_dynemb_find_or_insert_cuda(&f.t, &f.p, stream()), "dynemb find-or-insert kernels");
    return f.result();
}

// A pinned buffer for an op's counts, per thread and device: allocated once, as the host waits on
// it at every find_or_insert call.
int64_t *pinned_counts() {
    thread_local std::unordered_map<int, int64_t *> bufs;
    int64_t *&buf = bufs[c10::cuda::current_device()];
    if (!buf) {
        const cudaError_t e = cudaHostAlloc(reinterpret_cast<void **>(&buf), 8 * sizeof(int64_t), cudaHostAllocPortable);
        TORCH_CHECK(e == cudaSuccess, "torchfuse.dynemb: cudaHostAlloc of the counts buffer failed: ",
                    cudaGetErrorString(e));
    }
    return buf;
}

// Mapped pinned memory per thread and device for tf_dynemb_foi_params.host_counts (6 int64: the
// counts, keys taken, abort flag, sequence word), its device address, and the thread's last sequence
// number there (each call waits for a new one, so a late write of an earlier call never matches).
struct MappedCounts {
    int64_t *host = nullptr;
    int64_t *dev = nullptr;
    int64_t seq = 0;
};
MappedCounts &mapped_counts() {
    thread_local std::unordered_map<int, MappedCounts> bufs;
    MappedCounts &m = bufs[c10::cuda::current_device()];
    if (!m.host) {
        void *h = nullptr, *d = nullptr;
        cudaError_t e = cudaHostAlloc(&h, 8 * sizeof(int64_t), cudaHostAllocPortable | cudaHostAllocMapped);
        TORCH_CHECK(e == cudaSuccess, "torchfuse.dynemb: cudaHostAlloc of the mapped counts failed: ", cudaGetErrorString(e));
        e = cudaHostGetDevicePointer(&d, h, 0);
        TORCH_CHECK(e == cudaSuccess, "torchfuse.dynemb: cudaHostGetDevicePointer of the mapped counts failed: ",
                    cudaGetErrorString(e));
        m.host = static_cast<int64_t *>(h);
        m.dev = static_cast<int64_t *>(d);
        m.host[5] = 0;
    }
    return m;
}

// Waits until step 2's last block has written sequence word `seq` (foi_counts_to_host). The stream is
// queried now and then, so a failed kernel raises here instead of leaving the host spinning.
void wait_mapped_counts(const MappedCounts &m, int64_t seq, cudaStream_t s) {
    const volatile int64_t *h = m.host;
    for (uint32_t spins = 1; h[5] != seq; ++spins) {
        if (spins % 4096 == 0) {
            const cudaError_t e = cudaStreamQuery(s);
            if (e == cudaErrorNotReady) continue;
            check_launch(e, "dynemb find-or-insert kernels (at the host's wait)");
            TORCH_CHECK(h[5] == seq, "torchfuse.dynemb_find_or_insert_sync: internal error: the stream finished "
                        "without the kernels' counts");
        }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
}

// An event per thread and device, recorded behind the counts' copy when later work is queued before
// the host's wait (created once: every training batch into a full table waits on it).
cudaEvent_t counts_event() {
    thread_local std::unordered_map<int, cudaEvent_t> events;
    cudaEvent_t &e = events[c10::cuda::current_device()];
    if (!e)
        check_launch(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "dynemb counts event creation");
    return e;
}

// st: host tiers mapped (cuda_state)
DynembFoiSyncResult find_or_insert_sync_state(const at::Tensor &query, const DynembState &st, const DynembFoiArgs &args,
                                              const std::optional<at::Tensor> &n_valid,
                                              const std::optional<at::Tensor> &abort, bool keep_evicted,
                                              const std::function<void(const at::Tensor &)> &before_wait = nullptr) {
    const c10::cuda::CUDAGuard guard(st[kKeys].device());
    const DynembFoiLimits lim = dynemb_foi_limits(st, n_valid, abort);
    // 128-slot buckets: step 2 hands the counts over in mapped memory (other buckets: the copy and the
    // stream wait below)
    const bool mapped = st.bucket_size() == 128 && query.numel() > 0;
    MappedCounts *m = mapped ? &mapped_counts() : nullptr;
    const int64_t seq = m ? ++m->seq : 0;
    const DynembFoiResult r =
        launch_find_or_insert(query, st, args, lim.n_valid, lim.abort, keep_evicted, m ? m->dev : nullptr, seq);
    int64_t c[5] = {0, 0, 0, query.numel(), 0};
    if (m) {
        if (before_wait) before_wait(std::get<0>(r));  // queued behind step 2; the host does not wait for it
        wait_mapped_counts(*m, seq, c10::cuda::getCurrentCUDAStream().stream());
        const int64_t *h = m->host;
        for (int i = 0; i < 3; ++i) c[i] = h[i];
        c[3] = std::min(std::max<int64_t>(h[3], 0), query.numel());
        c[4] = h[4] ? 1 : 0;
        if (c[4]) c[3] = 0;  // none taken
    } else if (query.numel() > 0 || lim.abort) {  // counts, keys taken, abort flag: one copy each, one wait
        // (an empty batch's flag is read too: its caller raises on it)
        int64_t *h = pinned_counts();
        h[4] = 0;  // the flag is one byte
        const cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
        check_launch(cudaMemcpyAsync(h, std::get<4>(r).data_ptr<int64_t>(), 3 * sizeof(int64_t),
                                     cudaMemcpyDeviceToHost, s),
                     "dynemb find-or-insert counts copy");
        if (lim.n_valid)
            check_launch(cudaMemcpyAsync(h + 3, lim.n_valid, sizeof(int64_t), cudaMemcpyDeviceToHost, s),
                         "dynemb find-or-insert key count copy");
        if (lim.abort)
            check_launch(cudaMemcpyAsync(h + 4, lim.abort, 1, cudaMemcpyDeviceToHost, s),
                         "dynemb find-or-insert abort flag copy");
        if (before_wait) {
            // work that needs the slots only, queued behind the counts' copy: the host waits on an event
            // recorded before it (a stream sync would wait for it too), so the GPU runs it while the host
            // does its bookkeeping and the launches after this op
            cudaEvent_t copied = counts_event();
            check_launch(cudaEventRecord(copied, s), "dynemb find-or-insert counts event");
            before_wait(std::get<0>(r));
            check_launch(cudaEventSynchronize(copied), "dynemb find-or-insert kernels (at the host's wait)");
        } else {
            check_launch(cudaStreamSynchronize(s), "dynemb find-or-insert kernels (at the host's wait)");
        }
        for (int i = 0; i < 3; ++i) c[i] = h[i];
        if (lim.n_valid) c[3] = std::min(std::max<int64_t>(h[3], 0), query.numel());
        c[4] = lim.abort && reinterpret_cast<const uint8_t *>(h + 4)[0] ? 1 : 0;
        if (c[4]) c[3] = 0;  // none taken
    }
    return finish_find_or_insert(narrow_foi(r, c), c, st, keep_evicted,
                                 [&](const at::Tensor &sl, const at::Tensor &ni, at::Tensor &rows) {
        return CudaOps::evict_rows(sl, ni, query, st, rows, args.init_kind, args.a, args.b, args.seed);
    });
}

DynembFoiSyncResult find_or_insert_sync_cuda(const at::Tensor &query, at::TensorList table, int64_t epoch,
                                             bool allow_evict, int64_t policy, int64_t clock, int64_t init_kind,
                                             double a, double b, int64_t seed, bool with_rows,
                                             const std::optional<at::Tensor> &n_valid,
                                             const std::optional<at::Tensor> &abort, bool keep_evicted) {
    const DynembState st = cuda_state(table, "torchfuse.dynemb_find_or_insert_sync");
    return find_or_insert_sync_state(query, st, {epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows},
                                     n_valid, abort, keep_evicted);
}

// find_or_insert_sync with the batch's bags pooled (dynemb_pool through inv) queued before the host's
// wait. Keys evicted with keep_evicted: their slots' rows changed after that pool (the eviction row
// work runs after the wait), so the bags are pooled again; without it the kernels wrote those rows
// before the pool.
DynembFoiPoolResult find_or_insert_pool_cuda(const at::Tensor &query, at::TensorList table, int64_t epoch,
                                             bool allow_evict, int64_t policy, int64_t clock, int64_t init_kind,
                                             double a, double b, int64_t seed, bool with_rows,
                                             const std::optional<at::Tensor> &n_valid,
                                             const std::optional<at::Tensor> &abort, const at::Tensor &pool_offsets,
                                             const at::Tensor &pool_inv, const std::optional<at::Tensor> &pool_weights,
                                             bool pool_mean, bool keep_evicted) {
    const DynembState st = cuda_state(table, "torchfuse.dynemb_find_or_insert_pool");
    at::Tensor pooled;
    auto pool = [&](const at::Tensor &slots) {
        pooled = pool_cuda(slots, pool_offsets, pool_weights, st[kValues], st[kValuesHost], pool_mean, pool_inv);
    };
    DynembFoiSyncResult r = find_or_insert_sync_state(
        query, st, {epoch, allow_evict, policy, clock, init_kind, a, b, seed, with_rows}, n_valid, abort, keep_evicted,
        pool);
    if (!pooled.defined() || (keep_evicted && std::get<3>(r).size(1) > 0))  // none queued, or rows changed since
        pool(std::get<0>(r));
    return std::tuple_cat(r, std::make_tuple(pooled));
}

// ---- table-batched ops (parameters: dynemb_tables.cpp) ----

// The tables' states with their host tiers' device addresses.
std::vector<DynembState> cuda_states(at::TensorList tables, const char *op) {
    std::vector<DynembState> st = dynemb_states(tables, op);
    for (DynembState &s : st) {
        map_host(s.c.values, s[kValuesHost]);
        map_host(s.c.state, s[kStateHost]);
    }
    return st;
}

at::Tensor tables_lookup_cuda(const at::Tensor &query, at::IntArrayRef starts, at::TensorList tables,
                              at::IntArrayRef epochs) {
    const c10::cuda::CUDAGuard guard(query.device());
    DynembTablesProbe g = prepare_tables_probe(false, query, nullptr, starts,
                                               dynemb_states(tables, "torchfuse.dynemb_tables_lookup"), epochs, {});
    check_launch(tf_dynemb_tables_lookup_cuda(g.t.data(), g.p.data(), g.start.data(), (int)g.t.size(), stream()),
                 "dynemb tables lookup kernel");
    return g.slots;
}

DynembInsertResult tables_insert_cuda(const at::Tensor &query, at::Tensor &slots, at::IntArrayRef starts,
                                      at::TensorList tables, at::IntArrayRef epochs, const c10::List<bool> &allow_evict) {
    const c10::cuda::CUDAGuard guard(query.device());
    DynembTablesProbe g = prepare_tables_probe(true, query, &slots, starts,
                                               dynemb_states(tables, "torchfuse.dynemb_tables_insert"), epochs,
                                               allow_evict.vec());
    check_launch(tf_dynemb_tables_insert_cuda(g.t.data(), g.p.data(), g.start.data(), (int)g.t.size(), stream()),
                 "dynemb tables insert kernel");
    return g.result();
}

void tables_init_cuda(const at::Tensor &slots, const at::Tensor &keys, const std::optional<at::Tensor> &mask,
                      at::IntArrayRef starts, at::TensorList tables, at::IntArrayRef init_kinds, at::ArrayRef<double> a,
                      at::ArrayRef<double> b, at::IntArrayRef seeds) {
    const char *op = "torchfuse.dynemb_tables_init";
    const c10::cuda::CUDAGuard guard(slots.device());
    const auto st = cuda_states(tables, op);
    const auto start = tables_starts(starts, slots.numel(), st.size(), op);
    auto p = prepare_tables_init(slots, keys, mask, start, st, init_kinds, a, b, seeds);
    check_launch(tf_dynemb_tables_init_cuda(p.data(), start.data(), (int)p.size(), stream()), "dynemb tables init kernel");
}

void tables_touch_cuda(at::TensorList tables, const at::Tensor &slots, at::IntArrayRef starts, at::IntArrayRef policies,
                       at::IntArrayRef clocks) {
    const char *op = "torchfuse.dynemb_tables_touch";
    const c10::cuda::CUDAGuard guard(slots.device());
    const auto st = dynemb_states(tables, op);
    const auto start = tables_starts(starts, slots.numel(), st.size(), op);
    check_tables_touch(st, slots, policies, clocks);
    std::vector<int64_t *> sc(st.size());
    std::vector<int> pol(st.size());
    for (size_t i = 0; i < st.size(); ++i) {
        sc[i] = st[i].c.t.scores;
        pol[i] = (int)policies[i];
    }
    check_launch(tf_dynemb_tables_touch_cuda(sc.data(), slots.data_ptr<int64_t>(), start.data(), pol.data(),
                                             clocks.data(), (int)sc.size(), stream()),
                 "dynemb tables touch kernel");
}

void tables_update_cuda(const at::Tensor &slots, const at::Tensor &grad, at::IntArrayRef starts, at::TensorList tables,
                        int64_t opt, double lr, double eps, double beta1, double beta2, at::ArrayRef<double> step_sizes) {
    const char *op = "torchfuse.dynemb_tables_update";
    const c10::cuda::CUDAGuard guard(slots.device());
    const auto st = cuda_states(tables, op);
    const auto start = tables_starts(starts, slots.numel(), st.size(), op);
    auto p = prepare_tables_update(slots, grad, start, st, opt, lr, eps, beta1, beta2, step_sizes);
    check_launch(tf_dynemb_tables_update_cuda(p.data(), start.data(), (int)p.size(), stream()),
                 "dynemb tables update kernel");
}

at::Tensor tables_pool_cuda(const at::Tensor &slots, const at::Tensor &offsets, const std::optional<at::Tensor> &weights,
                            int64_t batch, at::IntArrayRef features, at::TensorList tables, const c10::List<bool> &mean) {
    const c10::cuda::CUDAGuard guard(slots.device());
    DynembTablesPool g = prepare_tables_pool(slots, offsets, weights, batch, features,
                                             cuda_states(tables, "torchfuse.dynemb_tables_pool"), mean.vec());
    check_launch(tf_dynemb_tables_pool_cuda(g.p.data(), g.start.data(), (int)g.p.size(), stream()),
                 "dynemb tables pool kernel");
    return g.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("dynemb_find_or_insert_sync", &find_or_insert_sync_cuda);
    m.impl("dynemb_find_or_insert_pool", &find_or_insert_pool_cuda);
    m.impl("dynemb_tables_lookup", &tables_lookup_cuda);
    m.impl("dynemb_tables_insert", &tables_insert_cuda);
    m.impl("dynemb_tables_init", &tables_init_cuda);
    m.impl("dynemb_tables_touch", &tables_touch_cuda);
    m.impl("dynemb_tables_update", &tables_update_cuda);
    m.impl("dynemb_tables_pool", &tables_pool_cuda);
    m.impl("dynemb_pool", &pool_cuda);
    m.impl("dynemb_segment_sum", &segsum_cuda);
    m.impl("dynemb_find", &find_cuda);
    m.impl("dynemb_gather", &gather_cuda);
    m.impl("dynemb_scatter", &scatter_cuda);
    m.impl("dynemb_segment_update", &segment_update_cuda);
    CudaOps::register_impls(m);
    m.impl("dynemb_host_rows", &host_rows_cuda);
}

}  // namespace torchfuse
