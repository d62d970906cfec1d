// Jagged tensor ops: the CUDA backend (checks and setup are shared with the CPU path in jagged.cpp).
// Nothing here reads device memory on the host: without the sizes passed in, only the ops that must
// size their output from offsets[-1] synchronize (in jagged.cpp).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "jagged.h"

namespace torchfuse {
namespace {

void check_launch(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void copy_cuda(const tfj_copy_params &p) {
    check_launch(tfj_copy_cuda(&p, c10::cuda::getCurrentCUDAStream().stream()), "jagged copy kernel");
}
void arith_cuda(const tfj_arith_params &p) {
    check_launch(tfj_arith_cuda(&p, c10::cuda::getCurrentCUDAStream().stream()), "jagged arithmetic kernel");
}

const JaggedBackend kCuda{copy_cuda, arith_cuda, false};

at::Tensor complete_cumsum_cuda(const at::Tensor &lengths) {
    const c10::cuda::CUDAGuard g(lengths.device());
    return jagged::complete_cumsum(kCuda, lengths);
}
at::Tensor to_padded_cuda(const at::Tensor &v, const at::Tensor &o, int64_t L, double pad) {
    const c10::cuda::CUDAGuard g(v.device());
    return jagged::to_padded_dense(kCuda, v, o, L, pad);
}
at::Tensor to_jagged_cuda(const at::Tensor &d, const at::Tensor &o, std::optional<int64_t> T) {
    const c10::cuda::CUDAGuard g(d.device());
    return jagged::dense_to_jagged(kCuda, d, o, T);
}
at::Tensor add_cuda(const at::Tensor &v, const at::Tensor &o, const at::Tensor &d) {
    const c10::cuda::CUDAGuard g(v.device());
    return jagged::dense_arith(kCuda, v, o, d, false);
}
at::Tensor mul_cuda(const at::Tensor &v, const at::Tensor &o, const at::Tensor &d) {
    const c10::cuda::CUDAGuard g(v.device());
    return jagged::dense_arith(kCuda, v, o, d, true);
}
std::tuple<at::Tensor, at::Tensor> concat_2d_cuda(const at::Tensor &vl, const std::optional<at::Tensor> &ol,
                                                  const at::Tensor &vr, const std::optional<at::Tensor> &orr,
                                                  std::optional<int64_t> ml, std::optional<int64_t> mr, int64_t pre) {
    const c10::cuda::CUDAGuard g(vl.device());
    return jagged::concat_2d(kCuda, vl, ol, vr, orr, ml, mr, pre);
}
std::tuple<at::Tensor, at::Tensor> split_2d_cuda(const at::Tensor &v, const std::optional<at::Tensor> &ol,
                                                 const std::optional<at::Tensor> &orr, std::optional<int64_t> ml,
                                                 std::optional<int64_t> mr, int64_t pre, std::optional<int64_t> tl,
                                                 std::optional<int64_t> tr) {
    const c10::cuda::CUDAGuard g(v.device());
    return jagged::split_2d(kCuda, v, ol, orr, ml, mr, pre, tl, tr);
}
std::tuple<at::Tensor, at::Tensor> concat_cuda(at::TensorList v, at::TensorList o) {
    TORCH_CHECK(!v.empty(), "torchfuse.jagged_concat: values_list must not be empty");
    const c10::cuda::CUDAGuard g(v[0].device());
    return jagged::concat(kCuda, v, o);
}
std::vector<at::Tensor> split_cuda(const at::Tensor &v, at::TensorList o, at::IntArrayRef t) {
    const c10::cuda::CUDAGuard g(v.device());
    return jagged::split(kCuda, v, o, t);
}
std::tuple<at::Tensor, at::Tensor> index_select_cuda(const at::Tensor &v, const at::Tensor &l, const at::Tensor &i,
                                                     std::optional<int64_t> t) {
    const c10::cuda::CUDAGuard g(v.device());
    return jagged::index_select(kCuda, v, l, i, t);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("complete_cumsum", &complete_cumsum_cuda);
    m.impl("jagged_to_padded_dense", &to_padded_cuda);
    m.impl("dense_to_jagged", &to_jagged_cuda);
    m.impl("jagged_dense_add", &add_cuda);
    m.impl("jagged_dense_mul", &mul_cuda);
    m.impl("concat_2d_jagged", &concat_2d_cuda);
    m.impl("split_2d_jagged", &split_2d_cuda);
    m.impl("jagged_concat", &concat_cuda);
    m.impl("jagged_split", &split_cuda);
    m.impl("jagged_index_select", &index_select_cuda);
}

}  // namespace torchfuse
