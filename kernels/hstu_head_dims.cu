/* Head-dim copies around the 16-bit HSTU kernels, which take head dims that are multiples of 8 (rows of
 * 16-byte multiples): other dims run on q, k, v (and dout) zero-padded to the next multiple of 8, and
 * their outputs are cut back (the glue's reasoning, csrc/hstu_cuda.cpp). Done as PyTorch ops that is
 * an allocation, a fill and a copy per padded tensor and a copy per cut one, a dozen launches and
 * their host cost per layer at GR's MovieLens head dim 25; here one launch pads (or cuts) up to four
 * tensors, and a cut also converts the backward's fp32 dq to the output dtype.
 *
 * hstu_head_copy: grid y = the plane (tensor), x strides over its 8-column output chunks; a thread
 * writes one chunk of one (row, head): out[l, h, c] = c < d_src ? src[l, h, c] : 0 for c < d_dst,
 * converted to the output dtype (round to nearest even, as Tensor.to). Inputs may be strided views
 * (q, k, v are column slices of one GEMM output), and so may outputs (dq written into the columns of
 * the caller's gradient buffer). */
#include <cuda_runtime.h>

#include "hstu_kernels.h"
#include "tf_vec.cuh"

namespace {

__global__ void __launch_bounds__(256) hstu_head_copy(tf_hstu_head_copy_params p) {
    const tf_hstu_head_plane &pl = p.planes[blockIdx.y];
    const int chunks = (pl.d_dst + TF_VEC - 1) / TF_VEC;
    const int64_t n = pl.L * pl.H * chunks;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int c0 = (int)(i % chunks) * TF_VEC;
        const int64_t lh = i / chunks, l = lh / pl.H, h = lh % pl.H;
        const int64_t src = l * pl.src_row_stride + h * pl.src_head_stride;
        const int64_t dst = pl.dst_row_stride ? l * pl.dst_row_stride + h * pl.dst_head_stride : lh * pl.d_dst;
        const int r = pl.d_src - c0;
        float v[TF_VEC];  // one 16-byte load (two for fp32) where the chunk is whole and aligned
        tf_load_chunk(tf_row(pl.src, pl.src_dtype, src, 1), pl.src_dtype, c0, r < 0 ? 0 : (r < TF_VEC ? r : TF_VEC), v);
        const int w = pl.d_dst - c0 < TF_VEC ? pl.d_dst - c0 : TF_VEC;
        tf_store_chunk(tf_row(pl.dst, pl.dst_dtype, dst, 1), pl.dst_dtype, c0, w, v);
    }
}

}  // namespace

extern "C" int tf_hstu_head_copy_cuda(const tf_hstu_head_copy_params *p, void *stream) {
    if (p->n < 1 || p->n > TF_HSTU_HEAD_PLANES) return (int)cudaErrorInvalidValue;
    int64_t most = 0;
    for (int i = 0; i < p->n; ++i) {
        const tf_hstu_head_plane &pl = p->planes[i];
        const int64_t c = pl.L * pl.H * ((pl.d_dst + TF_VEC - 1) / TF_VEC);
        most = c > most ? c : most;
    }
    if (most == 0) return 0;
    const int64_t blocks = (most + 255) / 256;
    hstu_head_copy<<<dim3((unsigned)(blocks < 4096 ? blocks : 4096), (unsigned)p->n), 256, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}
