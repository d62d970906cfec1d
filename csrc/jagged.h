// Jagged tensor ops: the device-independent glue (argument checks, output allocation, parameter setup)
// is written once in jagged.cpp against a backend that runs the kernels; jagged.cpp registers the CPU
// backend, jagged_cuda.cpp the CUDA one.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../kernels/jagged_kernels.h"

namespace torchfuse {

struct JaggedBackend {
    void (*copy)(const tfj_copy_params &p);
    void (*arith)(const tfj_arith_params &p);
    bool host_checks;  // CPU: offsets and indices are read and validated on the host before any kernel
};

namespace jagged {

at::Tensor complete_cumsum(const JaggedBackend &be, const at::Tensor &lengths);
at::Tensor to_padded_dense(const JaggedBackend &be, const at::Tensor &values, const at::Tensor &offsets,
                           int64_t max_length, double padding_value);
at::Tensor dense_to_jagged(const JaggedBackend &be, const at::Tensor &dense, const at::Tensor &offsets,
                           std::optional<int64_t> total_length);
at::Tensor dense_arith(const JaggedBackend &be, const at::Tensor &values, const at::Tensor &offsets,
                       const at::Tensor &dense, bool mul);
std::tuple<at::Tensor, at::Tensor> concat_2d(const JaggedBackend &be, const at::Tensor &values_left,
                                             const std::optional<at::Tensor> &offsets_left,
                                             const at::Tensor &values_right,
                                             const std::optional<at::Tensor> &offsets_right,
                                             std::optional<int64_t> max_len_left, std::optional<int64_t> max_len_right,
                                             int64_t n_prefix_from_right);
std::tuple<at::Tensor, at::Tensor> split_2d(const JaggedBackend &be, const at::Tensor &values,
                                            const std::optional<at::Tensor> &offsets_left,
                                            const std::optional<at::Tensor> &offsets_right,
                                            std::optional<int64_t> max_len_left, std::optional<int64_t> max_len_right,
                                            int64_t n_prefix_to_right, std::optional<int64_t> total_len_left,
                                            std::optional<int64_t> total_len_right);
std::tuple<at::Tensor, at::Tensor> concat(const JaggedBackend &be, at::TensorList values_list,
                                          at::TensorList offsets_list);
std::vector<at::Tensor> split(const JaggedBackend &be, const at::Tensor &values, at::TensorList offsets_list,
                              at::IntArrayRef totals);
std::tuple<at::Tensor, at::Tensor> index_select(const JaggedBackend &be, const at::Tensor &values,
                                                const at::Tensor &lengths, const at::Tensor &indices,
                                                std::optional<int64_t> total_length);

}  // namespace jagged
}  // namespace torchfuse
