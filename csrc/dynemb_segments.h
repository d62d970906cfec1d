// Shared by the CPU and CUDA glue of a lookup batch's layout (dynemb_segments.cpp, dynemb_segments_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

#include "../kernels/dynemb_segments_kernels.h"

namespace torchfuse {

// Checks sorted_ids / perm (torch.sort(ids, stable=True) of a flat batch: the CPU's dynemb_sort_segments)
// and allocates the grouping's outputs: params with uniq (n), seg (n + 1), inv (n) and n_unique (1) set; scratch is
// the caller's.
struct DynembSegments {
    at::Tensor uniq, seg, inv, n_unique;
    tf_dynemb_segments_params p;
};
DynembSegments prepare_dynemb_segments(const at::Tensor &sorted_ids, const at::Tensor &perm, const char *op);
// The grouping's outputs for a batch of n ids before it is sorted (dynemb_sort_segments): p.sorted and
// p.perm unset.
DynembSegments alloc_dynemb_segments(int64_t n, const at::TensorOptions &o);
// ids for dynemb_sort_segments: int64, 1-D, contiguous, fewer than 2^31.
void check_sort_segments_ids(const at::Tensor &ids);

// Checks offsets / n and allocates the bag layout's outputs: (full, bag_of, scale (n floats when mean,
// else empty), bad (1 uint8)).
struct DynembBagLayout {
    at::Tensor full, bag_of, scale, bad;
    tf_dynemb_bag_layout_params p;
};
DynembBagLayout prepare_dynemb_bag_layout(const at::Tensor &offsets, int64_t n, bool include_last, bool mean,
                                          bool with_bags);

}  // namespace torchfuse
