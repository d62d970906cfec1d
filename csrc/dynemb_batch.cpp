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
void check_sorted_pair(const at::Tensor &sorted_ids, const at::Tensor &perm, const char *op) {
    TORCH_CHECK_TYPE(sorted_ids.scalar_type() == at::kLong && perm.scalar_type() == at::kLong, op,
                     ": sorted_ids and perm must be int64, got ", sorted_ids.scalar_type(), " and ", perm.scalar_type());
    TORCH_CHECK(sorted_ids.dim() == 1 && perm.dim() == 1 && sorted_ids.numel() == perm.numel(), op,
                ": sorted_ids and perm must be 1-D of one length, got shapes ", sorted_ids.sizes(), " and ", perm.sizes());
    check_same_device(perm, sorted_ids, op, "perm", "sorted_ids");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_sorted(const at::Tensor &sorted_ids, const at::Tensor &perm) {
    check_sorted_pair(sorted_ids, perm, "torchfuse.dynemb_group_sorted");
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

// group_sorted without its host sync: the run of each sorted position by a scan of the boundaries,
// the distinct ids and the runs' first positions scattered into buffers of the batch's length
// (uniq past n_unique holds sorted_ids' entries there; seg past it holds n, so seg[n_unique] = n). A few more launches
// than unique_consecutive, no wait: the caller's next ops are queued behind them at once.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_sorted_async(const at::Tensor &sorted_ids,
                                                                              const at::Tensor &perm) {
    check_sorted_pair(sorted_ids, perm, "torchfuse.dynemb_group_sorted_async");
    const int64_t n = sorted_ids.numel();
    const at::TensorOptions o = perm.options();
    at::Tensor run = at::zeros({n}, o);  // run[q]: the index of sorted position q's id among the distinct ids
    if (n > 1) {
        at::Tensor tail = run.narrow(0, 1, n - 1);
        at::cumsum_out(tail, at::ne(sorted_ids.narrow(0, 1, n - 1), sorted_ids.narrow(0, 0, n - 1)), 0, at::kLong);
    }
    at::Tensor n_unique = n ? run.narrow(0, n - 1, 1) + 1 : at::zeros({1}, o);
    at::Tensor uniq = sorted_ids.clone();  // entries past n_unique keep sorted_ids' (defined contents)
    at::Tensor seg = at::full({n + 1}, n, o);
    at::Tensor inv = at::empty_like(perm);
    if (n) {
        uniq.scatter_(0, run, sorted_ids);  // a run's positions all write the same id
        seg.narrow(0, 0, n).scatter_reduce_(0, run, at::arange(n, o), "amin", /*include_self=*/true);
        inv.scatter_(0, perm, run);
    }
    return {uniq, seg, inv, n_unique};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
    m.impl("dynemb_group_sorted", &group_sorted);
    m.impl("dynemb_group_sorted_async", &group_sorted_async);
}
TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("dynemb_group_sorted", &group_sorted);
    m.impl("dynemb_group_sorted_async", &group_sorted_async);
}

}  // namespace torchfuse
