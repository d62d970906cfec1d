// HSTU output section + skinny linear for a few rows: the CUDA implementation (checks and setup live in
// hstu_output_skinny.cpp). Inputs the fused kernel does not take run the two kernels it replaces.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "hstu_output.h"
#include "hstu_output_skinny.h"
#include "skinny_linear.h"

namespace torchfuse {
namespace {

void check_launch(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse.hstu_compute_output: ", what, " failed: ",
                cudaGetErrorString(static_cast<cudaError_t>(err)));
}

at::Tensor hstu_output_skinny_cuda(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &x,
                                   const at::Tensor &norm_weight, const at::Tensor &norm_bias, double eps,
                                   const at::Tensor &output_weight, int64_t mul_act, int64_t cat_act, bool concat_u,
                                   bool concat_x) {
    const c10::cuda::CUDAGuard guard(attn.device());
    HstuOutputSkinny s = prepare_hstu_output_skinny(attn, u, x, norm_weight, norm_bias, eps, output_weight, mul_act,
                                                    cat_act, concat_u, concat_x);
    if (s.p.lin.M == 0 || s.p.lin.N == 0) return s.out;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    if (tf_skinny_hstu_output_cuda_applies(&s.p)) {
        check_launch(tf_skinny_hstu_output_cuda(&s.p, stream), "fused output-section kernel");
        return s.out;
    }
    // e.g. output_weight's rows not 16-byte aligned: y written by the output op, then the linear.
    // No dropout: the generator is neither read nor advanced.
    HstuOutputFwd f = prepare_hstu_output_fwd(attn, u, norm_weight, norm_bias, eps, 0, mul_act, cat_act, concat_u,
                                              concat_x, 0.0, std::nullopt);
    check_launch(tf_hstu_output_fwd_cuda(&f.p, stream), "output-section kernel");
    SkinnyLinear l = prepare_skinny_linear(f.y, output_weight, std::nullopt, x, std::nullopt, std::nullopt, eps);
    if (tf_skinny_linear_cuda_applies(&l.p))
        check_launch(tf_skinny_linear_cuda(&l.p, stream), "skinny linear kernel");
    else
        skinny_linear_composed(l);
    return l.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) { m.impl("hstu_output_skinny", hstu_output_skinny_cuda); }

}  // namespace torchfuse
