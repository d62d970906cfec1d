// Dynamic embedding hash table, CUDA path (semantics: dynemb_kernels.h; the CPU path dynemb_cpu.c is the
// reference).
//
// Thread mapping:
//   lookup / insert: one warp per queried key. Lane l reads digest word l of the key's bucket (4
//     digests; 32 lanes cover a 128-slot bucket in one 128-byte line) and compares the key only
//     where a digest matches; ballots and shuffles combine the lanes. Insert holds the bucket's lock
//     (lane 0 spins on atomicCAS) and reads the bucket through L2 (__ldcg): other warps may have
//     changed it since this kernel started.
//   gather / scatter: a group of up to 32 threads per row copies it in 16, 8, 4 or 2-byte units.
//   init / update: one warp per row, lanes striding over the row's elements (RowWiseAdagrad sums
//     the squared gradient across the warp).
//
// Shared by the dynamic embedding's kernel files (dynemb_probe.cu, dynemb_insert.cu, dynemb_rows.cu,
// dynemb_update.cu): element loads and stores, row copies, the bucket probes and the table-batched
// launch machinery. Internal linkage: each file gets its own copy.
#ifndef TF_DYNEMB_COMMON_CUH
#define TF_DYNEMB_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include "dynemb_kernels.h"

namespace {

constexpr int kBlock = 256;
constexpr int kWarpsPerBlock = kBlock / 32;

__device__ __forceinline__ float load_f32(const void *base, int dt, int64_t i) {
    if (dt == TF_F32) return static_cast<const float *>(base)[i];
    if (dt == TF_BF16) return __bfloat162float(static_cast<const __nv_bfloat16 *>(base)[i]);
    return __half2float(static_cast<const __half *>(base)[i]);
}

__device__ __forceinline__ void store_f32(void *base, int dt, int64_t i, float v) {
    if (dt == TF_F32) static_cast<float *>(base)[i] = v;
    else if (dt == TF_BF16) static_cast<__nv_bfloat16 *>(base)[i] = __float2bfloat16_rn(v);
    else static_cast<__half *>(base)[i] = __float2half_rn(v);
}

__device__ __forceinline__ int64_t warp_index() {
    return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}

// Multiprocessors of the current device (asked once per device).
inline int sm_count() {
    static int cache[64] = {0};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
    if (!cache[dev] && cudaDeviceGetAttribute(&cache[dev], cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
    return cache[dev];
}

inline unsigned grid_for_warps(int64_t warps) { return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock); }

/* Lane l of a group of G lanes copies units l, l + G, ... of a row of `units` T's (zeros when src is
 * NULL). Four loads are issued before the first store: the compiler cannot know dst and src never
 * overlap, so a plain copy loop waits for each load in turn (four round trips per lane for a
 * 512-byte row in a quarter warp). */
template <typename T, int G>
__device__ __forceinline__ void copy_units(T *dst, const T *src, int64_t units, int l) {
    for (int64_t u0 = l; u0 < units; u0 += 4 * G) {
        T v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int64_t u = u0 + k * G;
            if (src && u < units) v[k] = src[u];
            else memset(&v[k], 0, sizeof(T));
        }
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (u0 + k * G < units) dst[u0 + k * G] = v[k];
    }
}

// ---- probing ----

/* A warp probes key's bucket: each lane reads 4 digest bytes (one 32-bit word; a 128-slot bucket's
 * digests are one 128-byte line) and compares the key only where the digest matches. Returns the
 * ballot of lanes that found it (keys are unique in the table: at most one); `found` is that lane's
 * slot, -1 elsewhere. */
__device__ __forceinline__ unsigned warp_probe(const tf_dynemb_table &t, int64_t key, int lane, int64_t &found) {
    const uint64_t h = tf_dynemb_hash(key);
    const int64_t base = tf_dynemb_bucket(h, t.num_buckets) * t.bucket_size;
    const uint32_t d = tf_dynemb_digest(h);
    found = -1;
    if (lane < (t.bucket_size >> 2)) {
        const uint32_t w = __ldg(reinterpret_cast<const uint32_t *>(t.digests + base) + lane);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int64_t j = base + 4 * lane + b;
            if (((w >> (8 * b)) & 0xffu) == d && t.keys[j] == key) found = j;
        }
    }
    return __ballot_sync(0xffffffffu, found >= 0);
}

// ---- table-batched launches ----

/* One launch over several tables (a table-batched step, as FBGEMM's TBE): item i of the
 * concatenated batch (a key, a bag, a row) belongs to table t with start[t] <= i < start[t + 1];
 * each table's params already point at its own part of the batch (local index i - start[t]). A
 * single-table call is the N = 1 case. The struct travels as a __grid_constant__ kernel parameter
 * (up to 32 tables: about 5 KB, within sm_70+'s 32 KB parameter space), so there is no descriptor
 * copy to the device. */
template <typename P, int N>
struct Tables {
    P p[N];
    int64_t start[N + 1];
    int n;
};

// The table of item i (start[0] <= i < start[n]): the last t with start[t] <= i.
template <typename P, int N>
__device__ __forceinline__ int table_of(const Tables<P, N> &g, int64_t i) {
    int lo = 0, hi = g.n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (g.start[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

struct ProbeArgs {
    tf_dynemb_table t;
    tf_dynemb_probe p;
};

// Launches kernel<N> over the items [start[0], start[n]) of up to N tables per launch.
template <int N, typename P, typename Launch>
inline int launch_tables(const P *p, const int64_t *start, int n_tables, Launch launch) {
    for (int c = 0; c < n_tables; c += N) {
        Tables<P, N> g;
        g.n = n_tables - c < N ? n_tables - c : N;
        for (int t = 0; t < g.n; ++t) {
            g.p[t] = p[c + t];
            g.start[t] = start[c + t];
        }
        g.start[g.n] = start[c + g.n];
        const int64_t items = g.start[g.n] - g.start[0];
        if (items <= 0) continue;
        launch(g, items);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return static_cast<int>(err);
    }
    return 0;
}

// Dispatches a single table to the N = 1 instantiation (a small parameter block), several tables to N = 32.
#define TF_TABLES_LAUNCH(P, p, start, n_tables, KERNEL, GRID_OF_ITEMS, stream)                                \
    ((n_tables) == 1                                                                                     \
     ? launch_tables<1>(p, start, n_tables, [&](const Tables<P, 1> &g, int64_t items) {               \
               KERNEL<1><<<GRID_OF_ITEMS(items), kBlock, 0, stream>>>(g);                                \
           })                                                                                            \
         : launch_tables<TF_DYNEMB_TABLES_MAX>(p, start, n_tables,                                         \
                                               [&](const Tables<P, TF_DYNEMB_TABLES_MAX> &g, int64_t items) { \
                                               KERNEL<TF_DYNEMB_TABLES_MAX>                             \
                                                     <<<GRID_OF_ITEMS(items), kBlock, 0, stream>>>(g);   \
                                             }))

inline unsigned grid_for_threads(int64_t n) { return static_cast<unsigned>((n + kBlock - 1) / kBlock); }

// The warp's (or thread's) item: its table and local index; false past the end. Uniform per warp
// for warp-per-item kernels.
template <typename P, int N>
__device__ __forceinline__ bool tables_item(const Tables<P, N> &g, int64_t item, int &t, int64_t &local) {
    const int64_t i = g.start[0] + item;
    if (i >= g.start[g.n]) return false;
    t = N == 1 ? 0 : table_of(g, i);
    local = i - g.start[t];
    return true;
}

// The body of a warp-per-item table-batched kernel: Body(params of the item's table, local index, lane).
template <typename P, int N, typename Body>
__device__ __forceinline__ void warp_item(const Tables<P, N> &g, Body body) {
    int t;
    int64_t i;
    if (tables_item(g, warp_index(), t, i)) body(g.p[t], i, static_cast<int>(threadIdx.x & 31));
}

// The slot of `key` in its 128-slot bucket, or -1, to the 8 lanes of quarter q (lane ql of it reads
// digests 16 ql .. 16 ql + 15). Every lane of the warp calls it; invalid quarters get -1. With
// free_order, also the bucket's first empty slot in the key's rotated order (quarter_free_order), or
// 128 when it has none: where the key would be inserted.
__device__ __forceinline__ int quarter_free_order(const uint32_t (&ws)[4], int ql, int rot, unsigned skip) {
    int order = 128;
#pragma unroll
    for (int k = 0; k < 16; ++k)
        if (((ws[k >> 2] >> (8 * (k & 3))) & 0xffu) == 0 && !((skip >> k) & 1u)) order = min(order, (16 * ql + k - rot) & 127);
    return order;
}

// Keys of one bucket look for an empty slot from different places (hash bits the bucket index does
// not use), so concurrent inserts rarely race for one slot.
__device__ __forceinline__ int insert_rotation(uint64_t h) { return static_cast<int>((h >> 40) & 127u); }

__device__ __forceinline__ int64_t quarter_probe(const tf_dynemb_table &t, int64_t key, bool valid, int q, int ql,
                                                 int *free_order = nullptr) {
    const uint64_t h = tf_dynemb_hash(key);
    const int64_t base = tf_dynemb_bucket(h, t.num_buckets) * 128;
    const uint32_t d = tf_dynemb_digest(h);
    int64_t found = -1;
    uint32_t ws[4] = {0u, 0u, 0u, 0u};
    if (valid) {
        const uint4 w4 = __ldg(reinterpret_cast<const uint4 *>(t.digests + base) + ql);
        ws[0] = w4.x; ws[1] = w4.y; ws[2] = w4.z; ws[3] = w4.w;
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int64_t j = base + 16 * ql + 4 * k + b;
                if (((ws[k] >> (8 * b)) & 0xffu) == d && t.keys[j] == key) found = j;
            }
    }
    const unsigned m = (__ballot_sync(0xffffffffu, found >= 0) >> (8 * q)) & 0xffu;
    const int64_t hit = __shfl_sync(0xffffffffu, found, 8 * q + (m ? __ffs(m) - 1 : 0));
    if (free_order) {
        int order = quarter_free_order(ws, ql, insert_rotation(h), 0u);
        for (int o = 4; o > 0; o >>= 1) order = min(order, __shfl_xor_sync(0xffffffffu, order, o));
        *free_order = order;
    }
    return m ? hit : -1;
}

inline int copy_unit(const tf_dynemb_rows *r, const void *other) {
    uintptr_t bits = static_cast<uintptr_t>(r->row_bytes) | reinterpret_cast<uintptr_t>(r->hbm) |
                     reinterpret_cast<uintptr_t>(other) | reinterpret_cast<uintptr_t>(r->host);
    for (int u = 16; u > 1; u >>= 1)
        if ((bits & (u - 1)) == 0) return u;
    return 1;
}

__device__ __forceinline__ void init_one(const tf_dynemb_init_params &p, int64_t i, int lane) {
    const int64_t slot = p.slots[i];
    if (slot < 0 || (p.mask && !p.mask[i])) return;
    if (p.init_kind != TF_INIT_NONE) {
        char *row = tf_dynemb_row(&p.values, slot);
        for (int64_t j = lane; j < p.dim; j += 32)
            store_f32(row, p.dtype, j, static_cast<float>(tf_dynemb_init_value(p.init_kind, p.a, p.b, p.keys[i], p.seed, j)));
    }
    if (p.state.row_bytes) {
        float *st = reinterpret_cast<float *>(tf_dynemb_row(&p.state, slot));
        for (int64_t j = lane; j < p.state.row_bytes / 4; j += 32) st[j] = 0.f;
    }
}

// Probe arguments of n_tables tables, paired for the kernels and handed to launch(args, start, k) at
// most TF_DYNEMB_TABLES_MAX tables at a time.
template <typename Launch>
inline int probe_chunks(const tf_dynemb_table *t, const tf_dynemb_probe *p, const int64_t *start, int n_tables,
                        Launch launch) {
    for (int c = 0; c < n_tables; c += TF_DYNEMB_TABLES_MAX) {
        ProbeArgs a[TF_DYNEMB_TABLES_MAX];
        const int k = n_tables - c < TF_DYNEMB_TABLES_MAX ? n_tables - c : TF_DYNEMB_TABLES_MAX;
        for (int j = 0; j < k; ++j) a[j] = ProbeArgs{t[c + j], p[c + j]};
        const int err = launch(a, start + c, k);
        if (err) return err;
    }
    return 0;
}

}  // namespace

#endif  // TF_DYNEMB_COMMON_CUH
