// Dynamic embedding, CUDA: lookup (a key's slot) and find (its slot and row in one pass).

#include "dynemb_common.cuh"

namespace {

__device__ __forceinline__ void lookup_one(const tf_dynemb_table &t, const tf_dynemb_probe &p, int64_t i, int lane) {
    const int64_t key = p.query[i];
    int64_t found;
    const unsigned m = warp_probe(t, key, lane, found);
    if (lane == __ffs(m) - 1) {  // keys are unique in the table: at most one lane found it
        p.slots[i] = found;
        if (p.epoch > 0) t.marks[found] = p.epoch;
    }
    if (m == 0 && lane == 0) p.slots[i] = -1;
}

template <int N>
__global__ void lookup_kernel(const __grid_constant__ Tables<ProbeArgs, N> g) {
    warp_item(g, [](const ProbeArgs &a, int64_t i, int lane) { lookup_one(a.t, a.p, i, lane); });
}

// find: lookup_kernel's probe, then the same warp copies the row (zeros when absent) in 16-byte
// units when aligned (4-byte otherwise), so the slot never goes through memory between two kernels.
template <typename T>
__global__ void find_kernel(tf_dynemb_table t, const int64_t *query, int64_t n, int64_t *slots,
                            tf_dynemb_rows r, char *out) {
    const int64_t i = warp_index();
    const int lane = threadIdx.x & 31;
    if (i >= n) return;  // uniform per warp
    const int64_t key = query[i];
    int64_t found;
    const unsigned m = warp_probe(t, key, lane, found);
    const int64_t slot = m ? __shfl_sync(0xffffffffu, found, __ffs(m) - 1) : -1;
    if (lane == 0) slots[i] = slot;
    const T *src = slot < 0 ? nullptr : reinterpret_cast<const T *>(tf_dynemb_row(&r, slot));
    copy_units<T, 32>(reinterpret_cast<T *>(out + i * r.row_bytes), src, r.row_bytes / static_cast<int64_t>(sizeof(T)), lane);
}

/* find for 128-slot buckets, four keys per warp: quarter q (lanes 8q..8q+7) probes key 4w+q, each
 * lane reading 16 of the bucket's digests with one 16-byte load, then the quarter copies that key's
 * row (zeros when absent). A warp per key kept one probe in flight per 32 lanes; here four are, which
 * is what a latency-bound probe needs. */
template <typename T>
__global__ void find_quarter_kernel(tf_dynemb_table t, const int64_t *query, int64_t n, int64_t *slots,
                                    tf_dynemb_rows r, char *out) {
    const int lane = threadIdx.x & 31, q = lane >> 3, ql = lane & 7;
    const int64_t i = warp_index() * 4 + q;
    if (warp_index() * 4 >= n) return;  // uniform per warp
    const bool valid = i < n;
    const int64_t key = valid ? query[i] : 0;
    const int64_t slot = quarter_probe(t, key, valid, q, ql);
    if (!valid) return;
    if (ql == 0) slots[i] = slot;
    const T *src = slot < 0 ? nullptr : reinterpret_cast<const T *>(tf_dynemb_row(&r, slot));
    copy_units<T, 8>(reinterpret_cast<T *>(out + i * r.row_bytes), src, r.row_bytes / static_cast<int64_t>(sizeof(T)), ql);
}

}  // namespace

extern "C" {

int tf_dynemb_tables_lookup_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, const int64_t *start,
                                 int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return probe_chunks(t, p, start, n_tables, [&](const ProbeArgs *a, const int64_t *st, int k) {
        return TF_TABLES_LAUNCH(ProbeArgs, a, st, k, lookup_kernel, grid_for_warps, s);
    });
}

int tf_dynemb_lookup_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, void *stream) {
    const int64_t start[2] = {0, p->n};
    return tf_dynemb_tables_lookup_cuda(t, p, start, 1, stream);
}

int tf_dynemb_find_cuda(const tf_dynemb_table *t, const int64_t *query, int64_t n, int64_t *slots,
                        const tf_dynemb_rows *r, void *out, void *stream) {
    if (n == 0) return 0;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    char *o = static_cast<char *>(out);
    const bool wide = copy_unit(r, out) >= 16;
    if (t->bucket_size == 128) {  // four keys per warp
        const unsigned grid = grid_for_warps((n + 3) / 4);
        if (wide) find_quarter_kernel<uint4><<<grid, kBlock, 0, s>>>(*t, query, n, slots, *r, o);
        else find_quarter_kernel<uint16_t><<<grid, kBlock, 0, s>>>(*t, query, n, slots, *r, o);
    } else if (wide) {
        find_kernel<uint4><<<grid_for_warps(n), kBlock, 0, s>>>(*t, query, n, slots, *r, o);
    } else {
        find_kernel<uint16_t><<<grid_for_warps(n), kBlock, 0, s>>>(*t, query, n, slots, *r, o);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
