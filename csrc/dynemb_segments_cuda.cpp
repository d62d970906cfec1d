// A lookup batch's layout on CUDA (kernels/dynemb_segments_cuda.cu); checks in dynemb_segments.cpp.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "dynemb_segments.h"

namespace torchfuse {
namespace {

void check_launch(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// An empty batch's segments: n_unique = 0 and seg = {0}.
void write_empty_segments(const DynembSegments &g, cudaStream_t s) {
    check_launch(cudaMemsetAsync(g.p.n_unique, 0, sizeof(int64_t), s), "dynemb segments memset");
    check_launch(cudaMemsetAsync(g.p.seg, 0, sizeof(int64_t), s), "dynemb segments memset");
}

// Sort and grouping in one op (tf_dynemb_sort_segments_params): one scratch allocation for the sorted
// ids, the iota and int32 permutation, the run indices, the flags and both CUB temp storages.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sort_segments_cuda(const at::Tensor &ids) {
    const c10::cuda::CUDAGuard guard(ids.device());
    check_sort_segments_ids(ids);
    const int64_t n = ids.numel();
    const at::TensorOptions o = ids.options();
    DynembSegments g = alloc_dynemb_segments(n, o);
    at::Tensor perm = at::empty({n}, o);
    const cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
    if (n == 0) {
        write_empty_segments(g, s);
        return {perm, g.uniq, g.seg, g.inv, g.n_unique};
    }
    auto up = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    const int64_t sort_temp = up((int64_t)tf_dynemb_sort_temp_bytes(n)), scan_temp = up((int64_t)tf_dynemb_segments_temp_bytes(n));
    const int64_t b8 = up(n * 8), b4 = up(n * 4);
    at::Tensor scratch = at::empty({2 * b8 + 3 * b4 + sort_temp + scan_temp}, o.dtype(at::kByte));
    uint8_t *base = scratch.data_ptr<uint8_t>();
    tf_dynemb_sort_segments_params p{};
    p.g = g.p;
    p.ids = ids.data_ptr<int64_t>();
    p.sorted = reinterpret_cast<int64_t *>(base);
    p.g.run = reinterpret_cast<int64_t *>(base + b8);
    p.iota = reinterpret_cast<int32_t *>(base + 2 * b8);
    p.perm32 = reinterpret_cast<int32_t *>(base + 2 * b8 + b4);
    p.g.flags = reinterpret_cast<int32_t *>(base + 2 * b8 + 2 * b4);
    p.sort_temp = base + 2 * b8 + 3 * b4;
    p.sort_temp_bytes = (size_t)sort_temp;
    p.g.temp = base + 2 * b8 + 3 * b4 + sort_temp;
    p.g.temp_bytes = (size_t)scan_temp;
    p.g.sorted = p.sorted;
    p.g.perm = nullptr;
    p.g.perm32 = p.perm32;
    p.g.perm_out = perm.data_ptr<int64_t>();
    check_launch(tf_dynemb_sort_segments_cuda(&p, s), "dynemb sort-segments kernels");
    return {perm, g.uniq, g.seg, g.inv, g.n_unique};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bag_layout_cuda(const at::Tensor &offsets, int64_t n,
                                                                           bool include_last, bool mean,
                                                                           bool with_bags) {
    const c10::cuda::CUDAGuard guard(offsets.device());
    DynembBagLayout l = prepare_dynemb_bag_layout(offsets, n, include_last, mean, with_bags);
    const cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
    check_launch(cudaMemsetAsync(l.p.bad, 0, 1, s), "dynemb bag layout memset");
    check_launch(tf_dynemb_bag_layout_cuda(&l.p, s), "dynemb bag layout kernel");
    return {l.full, l.bag_of, l.scale, l.bad};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("dynemb_bag_layout", &bag_layout_cuda);
    m.impl("dynemb_sort_segments", &sort_segments_cuda);
}

}  // namespace torchfuse
