// The decode kernels' counters (kernels/hstu_decode.cu): each (sequence, head) pair's last block is found
// by counting its blocks, and that block resets the count, so a buffer zeroed once serves every later
// launch ordered after it. Launches that may run at the same time must not share one, hence a buffer
// per (device, stream) and, while a stream is being captured into a CUDA graph, per capture:
// - eager calls on a stream run one after another: they share the stream's buffer;
// - a capture gets its own buffer (two graphs captured on one stream may be replayed on two streams at
//   once), zeroed by a memset recorded into the graph before its first decode kernel: every replay
//   starts from zero even if it is the first use of that memory, and its kernels leave it zero;
// - streams forked into one capture are different streams: each has its own buffer and memset.
// The memory comes from cudaMalloc, not the caching allocator: a capture's allocations from the
// allocator belong to the graph's private pool, which torch.compile's CUDA graph trees check and reset
// to the tensors they track. As in PyTorch's allocator, cudaMalloc during a capture runs in
// relaxed capture mode (it enqueues nothing). Buffers are never freed: a graph holding the address may
// be replayed at any time, and an eager buffer may still be in use by queued kernels when it grows.
// They hold 4 bytes per pair: growth (doubling) and captures add a few KB each.
#include "hstu_decode_counters_cuda.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/util/Exception.h>

namespace torchfuse {
namespace {

struct Key {
    int device;
    cudaStream_t stream;
    bool capturing;
    unsigned long long capture;
    bool operator<(const Key &o) const {
        return std::tie(device, stream, capturing, capture) < std::tie(o.device, o.stream, o.capturing, o.capture);
    }
};

struct Buffer {
    unsigned int *ptr = nullptr;
    int64_t size = 0;
};

void check(cudaError_t e, const char *what) {
    TORCH_CHECK(e == cudaSuccess, "torchfuse: HSTU decode counters: ", what, " failed: ", cudaGetErrorString(e));
}

}  // namespace

unsigned int *hstu_decode_counters(cudaStream_t stream, int64_t n) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    check(cudaStreamGetCaptureInfo(stream, &status, &id), "cudaStreamGetCaptureInfo");
    const bool capturing = status != cudaStreamCaptureStatusNone;
    const Key key{c10::cuda::current_device(), stream, capturing, capturing ? id : 0ull};

    static std::mutex mu;
    static auto *buffers = new std::map<Key, Buffer>();  // never destroyed: graphs may outlive static teardown
    const std::lock_guard<std::mutex> lock(mu);
    Buffer &b = (*buffers)[key];
    if (b.size < n) {
        const int64_t size = std::max<int64_t>(n, std::max<int64_t>(2 * b.size, 1024));
        void *ptr = nullptr;
        {
            const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
            check(cudaMalloc(&ptr, (size_t)size * sizeof(unsigned int)), "cudaMalloc");
        }
        // on the stream: before this call's kernel, and recorded into the graph when capturing
        check(cudaMemsetAsync(ptr, 0, (size_t)size * sizeof(unsigned int), stream), "cudaMemsetAsync");
        b.ptr = static_cast<unsigned int *>(ptr);
        b.size = size;
    }
    return b.ptr;
}

}  // namespace torchfuse
