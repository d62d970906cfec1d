// Dynamic embedding, CUDA: row copies (gather, scatter), new rows from the initializer (init,
// init + gather) and bags pooled from the table.

#include "dynemb_common.cuh"

namespace {

// ---- row copies ----

// tpr threads per row (a power of two <= 32), each copying units of T strided by tpr.
template <typename T>
__global__ void gather_kernel(tf_dynemb_rows r, const int64_t *slots, const int64_t *order, int64_t n, char *out,
                              int tpr) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t j = t / tpr;
    if (j >= n) return;
    const int64_t i = order ? order[j] : j;  // order: rows in slot order, host rows in address order
    if (i < 0 || i >= n) return;
    const int64_t units = r.row_bytes / static_cast<int64_t>(sizeof(T));
    T *dst = reinterpret_cast<T *>(out + i * r.row_bytes);
    const int64_t slot = slots[i];
    if (slot < 0) {
        T zero;
        memset(&zero, 0, sizeof(T));
        for (int64_t u = t % tpr; u < units; u += tpr) dst[u] = zero;
        return;
    }
    const T *src = reinterpret_cast<const T *>(tf_dynemb_row(&r, slot));
    for (int64_t u = t % tpr; u < units; u += tpr) dst[u] = src[u];
}

template <typename T>
__global__ void scatter_kernel(tf_dynemb_rows r, const int64_t *slots, const int64_t *order, int64_t n,
                               const char *src, int tpr) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t j = t / tpr;
    if (j >= n) return;
    const int64_t i = order ? order[j] : j;
    if (i < 0 || i >= n || slots[i] < 0) return;
    const int64_t units = r.row_bytes / static_cast<int64_t>(sizeof(T));
    const T *s = reinterpret_cast<const T *>(src + i * r.row_bytes);
    T *dst = reinterpret_cast<T *>(tf_dynemb_row(&r, slots[i]));
    for (int64_t u = t % tpr; u < units; u += tpr) dst[u] = s[u];
}

int launch_rows(bool gather, const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n, void *buf,
                cudaStream_t s) {
    if (n == 0 || r->row_bytes == 0) return 0;
    const int unit = copy_unit(r, buf);
    const int64_t units = r->row_bytes / unit;
    int tpr = 1;
    while (tpr < 32 && tpr < units) tpr <<= 1;
    const unsigned grid = static_cast<unsigned>((n * tpr + kBlock - 1) / kBlock);
    char *b = static_cast<char *>(buf);
#define TF_ROWS(T)                                                                    \
    if (gather) gather_kernel<T><<<grid, kBlock, 0, s>>>(*r, slots, order, n, b, tpr); \
    else scatter_kernel<T><<<grid, kBlock, 0, s>>>(*r, slots, order, n, b, tpr);
    switch (unit) {
    case 16: TF_ROWS(uint4) break;
    case 8: TF_ROWS(uint2) break;
    case 4: TF_ROWS(uint32_t) break;
    case 2: TF_ROWS(uint16_t) break;
    default: TF_ROWS(uint8_t) break;
    }
#undef TF_ROWS
    return static_cast<int>(cudaGetLastError());
}

template <int N>
__global__ void init_kernel(const __grid_constant__ Tables<tf_dynemb_init_params, N> g) {
    warp_item(g, [](const tf_dynemb_init_params &a, int64_t i, int lane) { init_one(a, i, lane); });
}

/* init + gather in one pass (tf_dynemb_init_gather_cuda): G lanes per row (8, 16 or 32: the gather's
 * one copy unit T per lane, up to a warp), step j of the grid handling batch index order[j]. A new
 * row's values (init_one's) go to the table and to out from registers, its state is zeroed; any other
 * row is copied out as the gather does (zeros for slot -1). */
template <typename T, int G>
__global__ void init_gather_kernel(tf_dynemb_init_params p, const int64_t *order, char *out) {
    const int64_t j = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / G;
    const int lane = threadIdx.x % G;
    if (j >= p.n) return;
    const int64_t i = order ? order[j] : j;  // order: rows in slot order, host rows in address order
    if (i < 0 || i >= p.n) return;
    const int64_t vb = p.values.row_bytes, units = vb / static_cast<int64_t>(sizeof(T));
    char *o = out + i * vb;
    const int64_t slot = p.slots[i];
    if (slot < 0) {
        copy_units<T, G>(reinterpret_cast<T *>(o), nullptr, units, lane);
        return;
    }
    char *row = tf_dynemb_row(&p.values, slot);
    const bool is_new = p.mask[i] != 0;
    if (is_new && p.init_kind != TF_INIT_NONE) {
        const int64_t key = p.keys[i];
        for (int64_t c = lane; c < p.dim; c += G) {
            const float v = static_cast<float>(tf_dynemb_init_value(p.init_kind, p.a, p.b, key, p.seed, c));
            store_f32(row, p.dtype, c, v);
            store_f32(o, p.dtype, c, v);
        }
    } else {  // an old row, or a new one with no initializer (it keeps the row it had)
        copy_units<T, G>(reinterpret_cast<T *>(o), reinterpret_cast<const T *>(row), units, lane);
    }
    if (is_new && p.state.row_bytes) {
        float *st = reinterpret_cast<float *>(tf_dynemb_row(&p.state, slot));
        for (int64_t c = lane; c < p.state.row_bytes / 4; c += G) st[c] = 0.f;
    }
}

/* pool_one for fp32 rows of at most 128 columns, a multiple of 4: lane l sums columns 4l..4l+3 with
 * one 16-byte load per row. The lanes first load 32 of the bag's slots and weights at once and pass
 * them round by shuffle, so a row's load waits on no other load, and the loads of consecutive ids can
 * be in flight together. Same sums, in the same order, as the general loop. */
__device__ __forceinline__ void pool_one_f32x4(const tf_dynemb_pool_params &p, int64_t b, int lane) {
    const int64_t o = tf_dynemb_pool_out_index(&p, b);
    int64_t i0, i1;
    tf_dynemb_pool_bag(&p, b, &i0, &i1);
    const bool mine = 4 * lane < p.dim;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t c = i0; c < i1; c += 32) {
        const int64_t my = c + lane;
        const int64_t s = my < i1 ? tf_dynemb_pool_slot(&p, my) : -1;
        const float w = (p.weights && my < i1) ? p.weights[my] : 1.f;
        const int cnt = static_cast<int>(i1 - c < 32 ? i1 - c : 32);
#pragma unroll 4
        for (int k = 0; k < cnt; ++k) {
            const int64_t slot = __shfl_sync(0xffffffffu, s, k);
            const float wk = __shfl_sync(0xffffffffu, w, k);
            if (slot >= 0 && mine) {
                const float4 v = reinterpret_cast<const float4 *>(tf_dynemb_row(&p.values, slot))[lane];
                acc.x = __fadd_rn(acc.x, __fmul_rn(wk, v.x));  // rounded as the general loop rounds
                acc.y = __fadd_rn(acc.y, __fmul_rn(wk, v.y));
                acc.z = __fadd_rn(acc.z, __fmul_rn(wk, v.z));
                acc.w = __fadd_rn(acc.w, __fmul_rn(wk, v.w));
            }
        }
    }
    if (!mine) return;
    const float div = (p.mean && i1 > i0) ? static_cast<float>(i1 - i0) : 1.f;
    const float r[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) store_f32(p.out, p.out_dtype, o + 4 * lane + k, div != 1.f ? r[k] / div : r[k]);
}

// One warp per bag, lanes over columns; ids of the bag in order (fp32 accumulation).
__device__ __forceinline__ void pool_one(const tf_dynemb_pool_params &p, int64_t b, int lane) {
    if (p.dtype == TF_F32 && p.dim <= 128 && p.dim % 4 == 0 &&
        ((reinterpret_cast<uintptr_t>(p.values.hbm) | reinterpret_cast<uintptr_t>(p.values.host)) & 15) == 0) {
        pool_one_f32x4(p, b, lane);
        return;
    }
    const int64_t o = tf_dynemb_pool_out_index(&p, b);
    int64_t i0, i1;
    tf_dynemb_pool_bag(&p, b, &i0, &i1);
    for (int64_t c0 = 0; c0 < p.dim; c0 += 32 * 8) {
        float acc[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = 0.f;
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t slot = tf_dynemb_pool_slot(&p, i);
            if (slot < 0) continue;
            const float w = p.weights ? p.weights[i] : 1.f;
            const char *row = tf_dynemb_row(&p.values, slot);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int64_t j = c0 + lane + 32 * k;
                // a product then a sum, each rounded (never one FMA): the same bits on every path and the CPU
                if (j < p.dim) acc[k] = __fadd_rn(acc[k], p.weights ? __fmul_rn(w, load_f32(row, p.dtype, j)) : load_f32(row, p.dtype, j));
            }
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int64_t j = c0 + lane + 32 * k;
            if (j < p.dim) store_f32(p.out, p.out_dtype, o + j, (p.mean && i1 > i0) ? acc[k] / static_cast<float>(i1 - i0) : acc[k]);
        }
    }
}

template <int N>
__global__ void pool_kernel(const __grid_constant__ Tables<tf_dynemb_pool_params, N> g) {
    warp_item(g, [](const tf_dynemb_pool_params &a, int64_t b, int lane) { pool_one(a, b, lane); });
}

}  // namespace

extern "C" {

int tf_dynemb_tables_pool_cuda(const tf_dynemb_pool_params *p, const int64_t *start, int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return TF_TABLES_LAUNCH(tf_dynemb_pool_params, p, start, n_tables, pool_kernel, grid_for_warps, s);
}

int tf_dynemb_pool_cuda(const tf_dynemb_pool_params *p, void *stream) {
    const int64_t start[2] = {0, p->n_bags};
    return tf_dynemb_tables_pool_cuda(p, start, 1, stream);
}

int tf_dynemb_gather_cuda(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n, void *out,
                          void *stream) {
    return launch_rows(true, r, slots, order, n, out, static_cast<cudaStream_t>(stream));
}

int tf_dynemb_scatter_cuda(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n,
                           const void *src, void *stream) {
    return launch_rows(false, r, slots, order, n, const_cast<void *>(src), static_cast<cudaStream_t>(stream));
}

int tf_dynemb_tables_init_cuda(const tf_dynemb_init_params *p, const int64_t *start, int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return TF_TABLES_LAUNCH(tf_dynemb_init_params, p, start, n_tables, init_kernel, grid_for_warps, s);
}

int tf_dynemb_init_gather_cuda(const tf_dynemb_init_params *p, const int64_t *order, void *out, void *stream) {
    if (p->n == 0 || p->values.row_bytes == 0) {  // no row bytes: only the new rows' state to zero
        if (p->n == 0 || p->state.row_bytes == 0) return 0;
        return tf_dynemb_init_cuda(p, stream);
    }
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int unit = copy_unit(&p->values, out);
    const int64_t units = p->values.row_bytes / unit;
    const int g = units <= 8 ? 8 : units <= 16 ? 16 : 32;
    const unsigned grid = static_cast<unsigned>((p->n * g + kBlock - 1) / kBlock);
    char *o = static_cast<char *>(out);
#define TF_INIT_GATHER(T)                                                                 \
    if (g == 8) init_gather_kernel<T, 8><<<grid, kBlock, 0, s>>>(*p, order, o);           \
    else if (g == 16) init_gather_kernel<T, 16><<<grid, kBlock, 0, s>>>(*p, order, o);    \
    else init_gather_kernel<T, 32><<<grid, kBlock, 0, s>>>(*p, order, o);
    switch (unit) {
    case 16: TF_INIT_GATHER(uint4) break;
    case 8: TF_INIT_GATHER(uint2) break;
    case 4: TF_INIT_GATHER(uint32_t) break;
    case 2: TF_INIT_GATHER(uint16_t) break;
    default: TF_INIT_GATHER(uint8_t) break;
    }
#undef TF_INIT_GATHER
    return static_cast<int>(cudaGetLastError());
}

int tf_dynemb_init_cuda(const tf_dynemb_init_params *p, void *stream) {
    const int64_t start[2] = {0, p->n};
    return tf_dynemb_tables_init_cuda(p, start, 1, stream);
}

}  // extern "C"
