// A lookup batch's layout for the training paths of DynamicEmbedding and DynamicEmbeddingBag
// (kernels/dynemb_segments_kernels.h): the checks and outputs shared with the CUDA glue, and the CPU ops.
#include <torch/library.h>

#include <ATen/ATen.h>

#include "dynemb_segments.h"
#include "tf_check.h"

namespace torchfuse {

DynembSegments prepare_dynemb_segments(const at::Tensor &sorted_ids, const at::Tensor &perm, const char *op) {
    TORCH_CHECK_TYPE(sorted_ids.scalar_type() == at::kLong && perm.scalar_type() == at::kLong, op,
                     ": sorted_ids and perm must be int64, got ", sorted_ids.scalar_type(), " and ", perm.scalar_type());
    TORCH_CHECK(sorted_ids.dim() == 1 && perm.dim() == 1 && sorted_ids.numel() == perm.numel(), op,
                ": sorted_ids and perm must be 1-D of one length, got shapes ", sorted_ids.sizes(), " and ", perm.sizes());
    check_same_device(perm, sorted_ids, op, "perm", "sorted_ids");
    TORCH_CHECK(sorted_ids.is_contiguous() && perm.is_contiguous(), op, ": sorted_ids and perm must be contiguous");
    const int64_t n = sorted_ids.numel();
    TORCH_CHECK(n < (int64_t{1} << 31), op, ": at most 2^31 - 1 ids per batch, got ", n);
    DynembSegments g = alloc_dynemb_segments(n, perm.options());
    g.p.sorted = sorted_ids.data_ptr<int64_t>();
    g.p.perm = perm.data_ptr<int64_t>();
    return g;
}

DynembSegments alloc_dynemb_segments(int64_t n, const at::TensorOptions &o) {
    DynembSegments g;
    g.uniq = at::empty({n}, o);
    g.seg = at::empty({n + 1}, o);
    g.inv = at::empty({n}, o);
    g.n_unique = at::empty({1}, o);
    g.p = tf_dynemb_segments_params{};
    g.p.n = n;
    g.p.uniq = g.uniq.data_ptr<int64_t>();
    g.p.seg = g.seg.data_ptr<int64_t>();
    g.p.inv = g.inv.data_ptr<int64_t>();
    g.p.n_unique = g.n_unique.data_ptr<int64_t>();
    return g;
}

void check_sort_segments_ids(const at::Tensor &ids) {
    const char *op = "torchfuse.dynemb_sort_segments";
    TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, op, ": ids must be int64, got ", ids.scalar_type());
    TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous(), op, ": ids must be 1-D and contiguous, got shape ", ids.sizes());
    TORCH_CHECK(ids.numel() < (int64_t{1} << 31), op, ": at most 2^31 - 1 ids per batch, got ", ids.numel());
}

DynembBagLayout prepare_dynemb_bag_layout(const at::Tensor &offsets, int64_t n, bool include_last, bool mean,
                                          bool with_bags) {
    const char *op = "torchfuse.dynemb_bag_layout";
    TORCH_CHECK_TYPE(offsets.scalar_type() == at::kLong || offsets.scalar_type() == at::kInt, op,
                     ": offsets must be int32 or int64, got ", offsets.scalar_type());
    TORCH_CHECK(offsets.dim() == 1 && offsets.is_contiguous(), op, ": offsets must be 1-D and contiguous, got shape ",
                offsets.sizes());
    TORCH_CHECK(n >= 0, op, ": n must be >= 0, got ", n);
    const int64_t n_bags = include_last ? offsets.numel() - 1 : offsets.numel();
    TORCH_CHECK(n_bags >= 0, op, ": include_last_offset needs at least one offset");
    TORCH_CHECK(n_bags > 0 || n == 0, op, ": no bags for ", n, " ids");
    DynembBagLayout l;
    const at::TensorOptions o = offsets.options().dtype(at::kLong);
    l.full = at::empty({n_bags + 1}, o);
    l.bag_of = at::empty({with_bags ? n : 0}, o);
    l.scale = at::empty({mean && with_bags ? n : 0}, o.dtype(at::kFloat));
    l.bad = at::empty({1}, o.dtype(at::kByte));  // the CPU writes it; CUDA zeroes it first
    l.p = tf_dynemb_bag_layout_params{};
    l.p.offsets = offsets.data_ptr();
    l.p.offsets_64 = offsets.scalar_type() == at::kLong;
    l.p.n_in = offsets.numel();
    l.p.include_last = include_last;
    l.p.n = n;
    l.p.full = l.full.data_ptr<int64_t>();
    l.p.bag_of = with_bags ? l.bag_of.data_ptr<int64_t>() : nullptr;
    l.p.scale = mean && with_bags ? l.scale.data_ptr<float>() : nullptr;
    l.p.bad = l.bad.data_ptr<uint8_t>();
    return l;
}

namespace {

// The CPU's stable sort is ATen's.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sort_segments_cpu(const at::Tensor &ids) {
    check_sort_segments_ids(ids);
    auto [sorted_ids, perm] = at::sort(ids, /*stable=*/true, 0, false);
    DynembSegments g = prepare_dynemb_segments(sorted_ids, perm, "torchfuse.dynemb_sort_segments");
    tf_dynemb_segments_cpu(&g.p);
    return {perm, g.uniq, g.seg, g.inv, g.n_unique};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bag_layout_cpu(const at::Tensor &offsets, int64_t n,
                                                                          bool include_last, bool mean,
                                                                          bool with_bags) {
    DynembBagLayout l = prepare_dynemb_bag_layout(offsets, n, include_last, mean, with_bags);
    tf_dynemb_bag_layout_cpu(&l.p);
    return {l.full, l.bag_of, l.scale, l.bad};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
    m.impl("dynemb_bag_layout", &bag_layout_cpu);
    m.impl("dynemb_sort_segments", &sort_segments_cpu);
}

}  // namespace torchfuse
