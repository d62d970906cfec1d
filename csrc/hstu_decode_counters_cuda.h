// The split-key decode kernels' per-(sequence, head) counters (tf_hstu_params.decode_cnt).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace torchfuse {

// At least n counters, zero, for a decode launch on `stream` of the current device. They are kept
// between calls (the kernel leaves them zero again), so only a new buffer is zeroed: no per-call memset.
unsigned int *hstu_decode_counters(cudaStream_t stream, int64_t n);

}  // namespace torchfuse
