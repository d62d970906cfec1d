// The grouping of a lookup batch by id, shared by the training paths of DynamicEmbedding and
// DynamicEmbeddingBag. Plain ATen on either device: what it saves is the Python dispatch of the
// five ops it replaces (about 20 us each against 3-5 from C++), host time that a training step from
// an idle GPU waits for.
#include <torch/library.h>

#include <ATen/ATen.h>

#include "tf_check.h"

namespace torchfuse {
namespace {

// sorted_ids, perm: torch.sort(ids, stable=True) of the flat batch. Returns (uniq, seg, inv): the
// distinct ids in ascending order; seg (n_unique + 1) their runs' bounds in sorted order (the
// occurrences of uniq[u] are perm[seg[u]:seg[u + 1]]); inv (n) each id's index into uniq, in the
// batch's own order. One host sync: the number of distinct ids.
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_sorted(const at::Tensor &sorted_ids, const at::Tensor &perm) {
    const char *op = "torchfuse.dynemb_group_sorted";
    TORCH_CHECK_TYPE(sorted_ids.scalar_type() == at::kLong && perm.scalar_type() == at::kLong, op,
                     ": sorted_ids and perm must be int64, got ", sorted_ids.scalar_type(), " and ", perm.scalar_type());
    TORCH_CHECK(sorted_ids.dim() == 1 && perm.dim() == 1 && sorted_ids.numel() == perm.numel(), op,
                ": sorted_ids and perm must be 1-D of one length, got shapes ", sorted_ids.sizes(), " and ", perm.sizes());
    check_same_device(perm, sorted_ids, op, "perm", "sorted_ids");
    auto [uniq, inv_sorted, counts] = at::unique_consecutive(sorted_ids, /*return_inverse=*/true, /*return_counts=*/true);
    const int64_t n_unique = uniq.numel();
    at::Tensor seg = at::empty({n_unique + 1}, counts.options());
    seg.narrow(0, 0, 1).zero_();
    if (n_unique) {
        at::Tensor tail = seg.narrow(0, 1, n_unique);
        at::cumsum_out(tail, counts, 0);
    }
    at::Tensor inv = at::empty_like(perm);
    if (perm.numel()) inv.scatter_(0, perm, inv_sorted.reshape({-1}));
    return {uniq, seg, inv};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) { m.impl("dynemb_group_sorted", &group_sorted); }
TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) { m.impl("dynemb_group_sorted", &group_sorted); }

}  // namespace torchfuse
