// CUDA half of tf_philox_glue.h: a call without an explicit seed reserves 4 offsets of the current
// device's default generator (one Philox counter block column; see kernels/tf_philox.h).
#pragma once

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxCudaState.h>

#include "tf_philox_glue.h"

namespace torchfuse {

inline tf_philox_args philox_args_cuda(std::optional<int64_t> seed) {
    if (seed) return philox_args_cpu(seed);
    auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
    at::PhiloxCudaState st;
    {
        std::lock_guard<std::mutex> lock(gen->mutex_);
        st = gen->philox_cuda_state(4);
    }
    tf_philox_args a{};
    if (st.captured_) {
        a.seed_ptr = st.seed_.ptr;
        a.offset_ptr = st.offset_.ptr;
        a.offset_intragraph = st.offset_intragraph_;
    } else {
        a.seed = st.seed_.val;
        a.offset = st.offset_.val;
    }
    return a;
}

}  // namespace torchfuse
