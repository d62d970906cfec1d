// Seeds for the dropout kernels (kernels/tf_philox.h) from torch's generators, the way PyTorch's own
// fused dropout takes them: on CUDA through philox_cuda_state, which stays correct under CUDA graph
// capture; an explicit seed gives offset 0, so the same seed gives the same mask on CPU and CUDA.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <optional>

#include "../kernels/tf_philox.h"

namespace torchfuse {

// CPU, or any device when `seed` is given.
inline tf_philox_args philox_args_cpu(std::optional<int64_t> seed) {
    tf_philox_args a{};
    if (seed) {
        a.seed = (uint64_t)*seed;
        return a;
    }
    auto gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    a.seed = gen->random64();
    return a;
}

}  // namespace torchfuse
