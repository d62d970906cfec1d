// Dynamic embedding table ops: the CUDA implementation (checks and setup live in dynemb.cpp).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "dynemb.h"
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

at::Tensor lookup_cuda(const at::Tensor &query, const at::Tensor &keys, const at::Tensor &digests, at::Tensor &marks,
                       int64_t bucket_size, int64_t epoch) {
    const c10::cuda::CUDAGuard guard(keys.device());
    tf_dynemb_table t = dynemb_table(query, keys, digests, nullptr, marks, nullptr, bucket_size, "torchfuse.dynemb_lookup");
    at::Tensor slots = at::empty({query.numel()}, query.options());
    tf_dynemb_probe p{};
    p.n = query.numel();
    p.query = query.data_ptr<int64_t>();
    p.slots = slots.data_ptr<int64_t>();
    p.epoch = (int32_t)epoch;
    check_launch(tf_dynemb_lookup_cuda(&t, &p, stream()), "dynemb lookup kernel");
    return slots;
}

std::tuple<at::Tensor, at::Tensor> find_cuda(const at::Tensor &query, const at::Tensor &keys, const at::Tensor &digests,
                                             const at::Tensor &marks, const at::Tensor &rows, const at::Tensor &rows_host,
                                             int64_t bucket_size) {
    const char *op = "torchfuse.dynemb_find";
    const c10::cuda::CUDAGuard guard(keys.device());
    tf_dynemb_table t = dynemb_table(query, keys, digests, nullptr, marks, nullptr, bucket_size, op);
    tf_dynemb_rows r = dynemb_rows(rows, rows_host, keys, op, "rows");
    TORCH_CHECK(rows.size(0) + rows_host.size(0) == keys.numel(), op, ": rows must hold one row per slot (",
                keys.numel(), ")");
    map_host(r, rows_host);
    at::Tensor slots = at::empty({query.numel()}, query.options());
    at::Tensor out = at::empty(row_shape(rows, query.numel()), rows.options());
    check_launch(tf_dynemb_find_cuda(&t, query.data_ptr<int64_t>(), query.numel(), slots.data_ptr<int64_t>(), &r,
                                     out.data_ptr(), stream()),
                 "dynemb find kernel");
    return {out, slots};
}

DynembInsertResult insert_cuda(const at::Tensor &query, at::Tensor &slots, at::Tensor &keys, at::Tensor &digests,
                               at::Tensor &scores, at::Tensor &marks, at::Tensor &locks, int64_t bucket_size,
                               int64_t epoch, bool allow_evict) {
    const c10::cuda::CUDAGuard guard(keys.device());
    DynembInsert ins = prepare_dynemb_insert(query, slots, keys, digests, scores, marks, &locks, bucket_size, epoch,
                                             allow_evict);
    check_launch(tf_dynemb_insert_cuda(&ins.t, &ins.p, stream()), "dynemb insert kernel");
    return ins.result();
}

void touch_cuda(at::Tensor &scores, const at::Tensor &slots, int64_t policy, int64_t clock) {
    const c10::cuda::CUDAGuard guard(scores.device());
    check_index(scores, scores, "torchfuse.dynemb_touch", "scores");
    check_index(slots, scores, "torchfuse.dynemb_touch", "slots");
    check_launch(tf_dynemb_touch_cuda(scores.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), slots.numel(), (int)policy,
                                      clock, stream()),
                 "dynemb touch kernel");
}

at::Tensor gather_cuda(const at::Tensor &slots, const at::Tensor &rows, const at::Tensor &rows_host) {
    const c10::cuda::CUDAGuard guard(rows.device());
    check_index(slots, rows, "torchfuse.dynemb_gather", "slots");
    tf_dynemb_rows r = dynemb_rows(rows, rows_host, rows, "torchfuse.dynemb_gather", "rows");
    map_host(r, rows_host);
    at::Tensor out = at::empty(row_shape(rows, slots.numel()), rows.options());
    check_launch(tf_dynemb_gather_cuda(&r, slots.data_ptr<int64_t>(), slots.numel(), out.data_ptr(), stream()),
                 "dynemb gather kernel");
    return out;
}

void scatter_cuda(const at::Tensor &slots, const at::Tensor &src, at::Tensor &rows, at::Tensor &rows_host) {
    const char *op = "torchfuse.dynemb_scatter";
    const c10::cuda::CUDAGuard guard(rows.device());
    check_index(slots, rows, op, "slots");
    tf_dynemb_rows r = dynemb_rows(rows, rows_host, rows, op, "rows");
    map_host(r, rows_host);
    check_same_device(src, rows, op, "src", "rows");
    TORCH_CHECK(src.dim() == 2 && src.size(0) == slots.numel() && src.size(1) == rows.size(1) &&
                    src.scalar_type() == rows.scalar_type(),
                op, ": src must be (", slots.numel(), ", ", rows.size(1), ") ", rows.scalar_type(), ", got ",
                src.scalar_type(), " ", src.sizes());
    at::Tensor s = src.contiguous();
    check_launch(tf_dynemb_scatter_cuda(&r, slots.data_ptr<int64_t>(), slots.numel(), s.data_ptr(), stream()),
                 "dynemb scatter kernel");
}

void init_cuda(const at::Tensor &slots, const at::Tensor &keys, const std::optional<at::Tensor> &mask,
               at::Tensor &values, at::Tensor &values_host, at::Tensor &state, at::Tensor &state_host,
               int64_t init_kind, double a, double b, int64_t seed) {
    const c10::cuda::CUDAGuard guard(values.device());
    tf_dynemb_init_params p =
        dynemb_init_params(slots, keys, mask, values, values_host, state, state_host, init_kind, a, b, seed);
    map_host(p.values, values_host);
    map_host(p.state, state_host);
    check_launch(tf_dynemb_init_cuda(&p, stream()), "dynemb init kernel");
}

void update_cuda(const at::Tensor &slots, const at::Tensor &grad, at::Tensor &values, at::Tensor &values_host,
                 at::Tensor &state, at::Tensor &state_host, int64_t opt, double lr, double eps, double beta1,
                 double beta2, double step_size) {
    const c10::cuda::CUDAGuard guard(values.device());
    tf_dynemb_update_params p = dynemb_update_params(slots, grad, values, values_host, state, state_host, opt, lr, eps,
                                                     beta1, beta2, step_size);
    map_host(p.values, values_host);
    map_host(p.state, state_host);
    check_launch(tf_dynemb_update_cuda(&p, stream()), "dynemb update kernel");
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
                     const at::Tensor &rows, const at::Tensor &rows_host, bool mean) {
    const c10::cuda::CUDAGuard guard(rows.device());
    at::Tensor out;
    tf_dynemb_pool_params p = dynemb_pool_params(slots, offsets, weights, rows, rows_host, mean, out);
    map_host(p.values, rows_host);
    check_launch(tf_dynemb_pool_cuda(&p, stream()), "dynemb pool kernel");
    return out;
}

at::Tensor segsum_cuda(const at::Tensor &grad, const at::Tensor &perm, const at::Tensor &seg,
                       const std::optional<at::Tensor> &bag_of, const std::optional<at::Tensor> &scale) {
    const c10::cuda::CUDAGuard guard(grad.device());
    at::Tensor out;
    tf_dynemb_segsum_params p = dynemb_segsum_params(grad, perm, seg, bag_of, scale, out);
    // scratch for the chunk sums of ids cut by a chunk edge (kernels/dynemb.h)
    const at::Tensor partial = at::empty({2 * tf_dynemb_seg_chunks(p.n_occ), p.dim}, out.options());
    p.partial = partial.data_ptr<float>();
    check_launch(tf_dynemb_segsum_cuda(&p, stream()), "dynemb segment-sum kernel");
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("dynemb_pool", &pool_cuda);
    m.impl("dynemb_segment_sum", &segsum_cuda);
    m.impl("dynemb_lookup", &lookup_cuda);
    m.impl("dynemb_insert", &insert_cuda);
    m.impl("dynemb_find", &find_cuda);
    m.impl("dynemb_touch", &touch_cuda);
    m.impl("dynemb_gather", &gather_cuda);
    m.impl("dynemb_scatter", &scatter_cuda);
    m.impl("dynemb_init", &init_cuda);
    m.impl("dynemb_update", &update_cuda);
    m.impl("dynemb_host_rows", &host_rows_cuda);
}

}  // namespace torchfuse
