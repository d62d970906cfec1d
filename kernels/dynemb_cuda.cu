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
int sm_count() {
    static int cache[64] = {0};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
    if (!cache[dev] && cudaDeviceGetAttribute(&cache[dev], cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
    return cache[dev];
}

unsigned grid_for_warps(int64_t warps) { return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock); }

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

// ---- grouped launches ----

/* One launch over several tables (a table-batched step, as FBGEMM's TBE): item i of the
 * concatenated batch (a key, a bag, a row) belongs to table t with start[t] <= i < start[t + 1];
 * each table's params already point at its own part of the batch (local index i - start[t]). A
 * single-table call is the N = 1 case. The struct travels as a __grid_constant__ kernel parameter
 * (up to 32 tables: about 5 KB, within sm_70+'s 32 KB parameter space), so there is no descriptor
 * copy to the device. */
template <typename P, int N>
struct Group {
    P p[N];
    int64_t start[N + 1];
    int n;
};

// The table of item i (start[0] <= i < start[n]): the last t with start[t] <= i.
template <typename P, int N>
__device__ __forceinline__ int group_table(const Group<P, N> &g, int64_t i) {
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

struct TouchArgs {
    int64_t *scores;
    const int64_t *slots;
    int policy;
    int64_t clock;
};

// Launches kernel<N> over the items [start[0], start[n]) of up to N tables per launch.
template <int N, typename P, typename Launch>
int launch_group(const P *p, const int64_t *start, int n_tables, Launch launch) {
    for (int c = 0; c < n_tables; c += N) {
        Group<P, N> g;
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

// Dispatches a single table to the N = 1 instantiation (a small parameter block), groups to N = 32.
#define TF_GROUP_LAUNCH(P, p, start, n_tables, KERNEL, GRID_OF_ITEMS, stream)                                \
    ((n_tables) == 1                                                                                     \
         ? launch_group<1>(p, start, n_tables, [&](const Group<P, 1> &g, int64_t items) {               \
               KERNEL<1><<<GRID_OF_ITEMS(items), kBlock, 0, stream>>>(g);                                \
           })                                                                                            \
         : launch_group<TF_DYNEMB_GROUP_MAX>(p, start, n_tables,                                         \
                                             [&](const Group<P, TF_DYNEMB_GROUP_MAX> &g, int64_t items) { \
                                                 KERNEL<TF_DYNEMB_GROUP_MAX>                             \
                                                     <<<GRID_OF_ITEMS(items), kBlock, 0, stream>>>(g);   \
                                             }))

unsigned grid_for_threads(int64_t n) { return static_cast<unsigned>((n + kBlock - 1) / kBlock); }

// The warp's (or thread's) item: its table and local index; false past the end. Uniform per warp
// for warp-per-item kernels.
template <typename P, int N>
__device__ __forceinline__ bool group_item(const Group<P, N> &g, int64_t item, int &t, int64_t &local) {
    const int64_t i = g.start[0] + item;
    if (i >= g.start[g.n]) return false;
    t = N == 1 ? 0 : group_table(g, i);
    local = i - g.start[t];
    return true;
}

// The body of a warp-per-item group kernel: Body(params of the item's table, local index, lane).
template <typename P, int N, typename Body>
__device__ __forceinline__ void warp_item(const Group<P, N> &g, Body body) {
    int t;
    int64_t i;
    if (group_item(g, warp_index(), t, i)) body(g.p[t], i, static_cast<int>(threadIdx.x & 31));
}

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
__global__ void lookup_kernel(const __grid_constant__ Group<ProbeArgs, N> g) {
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

/* Step 1 of find_or_insert lists the keys it could not place for step 2 (their bucket was full:
 * step 2 evicts), so that step 2 runs a quarter warp per such key instead of over every key with
 * most quarters idle. Per key: the key, its index in the batch, and the slot within its bucket where
 * it would go by step 1's reading of the digests (255: none empty). A block appends its keys with one
 * atomic on the count (the list's order is the blocks' arrival order: slot placement on the GPU never
 * was deterministic). The header's second word counts the keys step 1 inserted itself (step 2 adds
 * it to counts[0]). Layout: tf_dynemb_foi_miss_bytes. */
struct MissList {
    unsigned long long *count;     // zeroed before step 1, with `inserted` and `done`
    unsigned long long *inserted;
    unsigned long long *done;      // step 2's finished blocks (tf_dynemb_foi_params.host_counts)
    int64_t *keys;
    int32_t *index;
    uint8_t *first;
};

// How many of the batch's keys the find-or-insert kernels take (tf_dynemb_foi_params.n_valid); 0 when
// the caller's abort flag is set. Uniform over the grid.
__device__ __forceinline__ int64_t foi_count(const tf_dynemb_foi_params &p) {
    if (p.abort && *p.abort) return 0;
    if (!p.n_valid) return p.p.n;
    const int64_t n = *p.n_valid;
    return n < p.p.n ? n : p.p.n;
}

__device__ __forceinline__ MissList miss_list(uint8_t *miss, int64_t n) {
    unsigned long long *h = reinterpret_cast<unsigned long long *>(miss);
    return MissList{h, h + 1, h + 2, reinterpret_cast<int64_t *>(miss + 32), reinterpret_cast<int32_t *>(miss + 32 + 8 * n),
                    miss + 32 + 12 * n};
}

// Every thread of the block calls it; `missed` and `inserted` are read at the quarter leaders
// (lane % 8 == 0).
__device__ __forceinline__ void list_misses(MissList ml, bool missed, bool inserted, int64_t key, int64_t i,
                                            int order, int rot) {
    __shared__ unsigned bits[kWarpsPerBlock];
    __shared__ unsigned long long base;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const unsigned b = __ballot_sync(0xffffffffu, missed && (lane & 7) == 0);
    const unsigned ib = __ballot_sync(0xffffffffu, inserted && (lane & 7) == 0);
    // 16 bits each: a warp has at most 4 quarter leaders
    if (lane == 0) bits[w] = static_cast<unsigned>(__popc(b)) | (static_cast<unsigned>(__popc(ib)) << 16);
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned c = 0, ins = 0;
        for (int x = 0; x < kWarpsPerBlock; ++x) {
            c += bits[x] & 0xffffu;
            ins += bits[x] >> 16;
        }
        base = c ? atomicAdd(ml.count, static_cast<unsigned long long>(c)) : 0ull;
        if (ins) atomicAdd(ml.inserted, static_cast<unsigned long long>(ins));
    }
    __syncthreads();
    if (missed && (lane & 7) == 0) {
        int64_t r = static_cast<int64_t>(base) + __popc(b & ((1u << lane) - 1u));
        for (int x = 0; x < w; ++x) r += bits[x] & 0xffffu;
        ml.keys[r] = key;
        ml.index[r] = static_cast<int32_t>(i);
        ml.first[r] = static_cast<uint8_t>(order < 128 ? (order + rot) & 127 : 255);
    }
}

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

// (valid, score, slot) ordered by score then slot; invalid loses.
__device__ __forceinline__ void min_victim(int64_t &s, int64_t &j, int64_t s2, int64_t j2) {
    if (j2 >= 0 && (j < 0 || s2 < s || (s2 == s && j2 < j))) { s = s2; j = j2; }
}

// Returns, to every lane, the index in evicted_* of the key this insert evicted, or -1.
__device__ __forceinline__ int64_t insert_one(const tf_dynemb_table &t, const tf_dynemb_probe &p, int64_t i, int lane) {
    if (p.slots[i] >= 0) return -1;  // uniform per warp
    const int64_t key = p.query[i];
    const uint64_t h = tf_dynemb_hash(key);
    const int64_t bucket = tf_dynemb_bucket(h, t.num_buckets);
    const int64_t base = bucket * t.bucket_size;
    const uint32_t d = tf_dynemb_digest(h);

    if (lane == 0)
        while (atomicCAS(&t.locks[bucket], 0, 1) != 0) __nanosleep(32);
    __syncwarp();
    __threadfence();

    int64_t found = -1, empty = INT64_MAX, vs = 0, vj = -1;
    const bool active = lane < (t.bucket_size >> 2);
    const uint32_t w = active ? __ldcg(reinterpret_cast<const uint32_t *>(t.digests + base) + lane) : 0u;
    if (active) {
        for (int b = 0; b < 4; ++b) {
            const int64_t j = base + 4 * lane + b;
            const uint32_t dj = (w >> (8 * b)) & 0xffu;
            if (dj == 0) { if (empty == INT64_MAX) empty = j; }
            else if (dj == d && __ldcg(&t.keys[j]) == key) found = j;
        }
    }
    const unsigned fm = __ballot_sync(0xffffffffu, found >= 0);
    if (fm) found = __shfl_sync(0xffffffffu, found, __ffs(fm) - 1);
    for (int o = 16; o > 0; o >>= 1) empty = min(empty, __shfl_xor_sync(0xffffffffu, empty, o));
    if (!fm && empty == INT64_MAX && p.allow_evict) {  // bucket full: the victim, reading marks and scores
        if (active) {
            for (int b = 0; b < 4; ++b) {
                const int64_t j = base + 4 * lane + b;
                if (__ldcg(&t.marks[j]) != p.epoch) min_victim(vs, vj, __ldcg(&t.scores[j]), j);
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const int64_t s2 = __shfl_xor_sync(0xffffffffu, vs, o), j2 = __shfl_xor_sync(0xffffffffu, vj, o);
            min_victim(vs, vj, s2, j2);
        }
    }
    int64_t ev = -1;
    if (lane == 0) {
        if (found >= 0) {
            p.slots[i] = found;  // a repeat of this key was placed first
        } else if (empty != INT64_MAX || (p.allow_evict && vj >= 0)) {
            int64_t slot = empty;
            if (empty == INT64_MAX) {
                slot = vj;
                const unsigned long long e = atomicAdd(reinterpret_cast<unsigned long long *>(&p.counts[1]), 1ull);
                ev = static_cast<int64_t>(e);
                p.evicted_keys[e] = __ldcg(&t.keys[slot]);
                p.evicted_slots[e] = slot;
                p.evicted_scores[e] = vs;
            }
            t.keys[slot] = key;
            t.scores[slot] = 0;
            t.marks[slot] = p.epoch;
            t.digests[slot] = static_cast<uint8_t>(d);
            p.slots[i] = slot;
            p.is_new[i] = 1;
            atomicAdd(reinterpret_cast<unsigned long long *>(&p.counts[0]), 1ull);
        } else {
            atomicAdd(reinterpret_cast<unsigned long long *>(&p.counts[2]), 1ull);
        }
        __threadfence();
        atomicExch(&t.locks[bucket], 0);
    }
    return __shfl_sync(0xffffffffu, ev, 0);
}

template <int N>
__global__ void insert_kernel(const __grid_constant__ Group<ProbeArgs, N> g) {
    warp_item(g, [](const ProbeArgs &a, int64_t i, int lane) { insert_one(a.t, a.p, i, lane); });
}

template <int N>
__global__ void touch_kernel(const __grid_constant__ Group<TouchArgs, N> g) {
    int t;
    int64_t i;
    if (!group_item(g, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, t, i)) return;
    const TouchArgs &a = g.p[t];
    const int64_t slot = a.slots[i];
    if (slot < 0) return;
    if (a.policy == TF_DYNEMB_LFU) atomicAdd(reinterpret_cast<unsigned long long *>(&a.scores[slot]), 1ull);
    else a.scores[slot] = a.clock;
}

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

int copy_unit(const tf_dynemb_rows *r, const void *other) {
    uintptr_t bits = static_cast<uintptr_t>(r->row_bytes) | reinterpret_cast<uintptr_t>(r->hbm) |
                     reinterpret_cast<uintptr_t>(other) | reinterpret_cast<uintptr_t>(r->host);
    for (int u = 16; u > 1; u >>= 1)
        if ((bits & (u - 1)) == 0) return u;
    return 1;
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

// ---- row math ----

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

/* A warp (or quarter warp, G = 8) per eviction (tf_dynemb_evict_params): the victim's row and state
 * copied out, then the new key's row written to the slot and to the output from registers. The
 * barrier orders the lanes' reads of the old row before any lane's writes of the new one. */
template <typename T, int G>
__global__ void evict_rows_kernel(tf_dynemb_evict_params p) {
    // G lanes per eviction: 32, or 8 for rows of at most 128 bytes (four rows in flight per warp)
    const int64_t e = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / G;
    const int lane = threadIdx.x % G;
    if (e >= p.n) return;
    const tf_dynemb_init_params &in = p.init;
    const int64_t slot = p.slots[e], i = p.new_index[e];
    const int64_t vb = in.values.row_bytes, sb = in.state.row_bytes;
    char *row = tf_dynemb_row(&in.values, slot);
    copy_units<T, G>(reinterpret_cast<T *>(static_cast<char *>(p.old_values) + e * vb), reinterpret_cast<const T *>(row),
                      vb / static_cast<int64_t>(sizeof(T)), lane);
    if (sb) {
        float *st = reinterpret_cast<float *>(tf_dynemb_row(&in.state, slot));
        copy_units<float, G>(p.old_state + e * (sb / 4), st, sb / 4, lane);
        __syncwarp(G == 32 ? 0xffffffffu : 0xffu << (threadIdx.x & 24));
        for (int64_t j = lane; j < sb / 4; j += G) st[j] = 0.f;
    }
    __syncwarp(G == 32 ? 0xffffffffu : 0xffu << (threadIdx.x & 24));
    char *o = p.rows_out ? static_cast<char *>(p.rows_out) + i * vb : nullptr;
    if (in.init_kind != TF_INIT_NONE) {
        const int64_t key = p.keys[i];
        for (int64_t j = lane; j < in.dim; j += G) {
            const float v = static_cast<float>(tf_dynemb_init_value(in.init_kind, in.a, in.b, key, in.seed, j));
            store_f32(row, in.dtype, j, v);
            if (o) store_f32(o, in.dtype, j, v);
        }
    } else if (o) {
        copy_units<T, G>(reinterpret_cast<T *>(o), reinterpret_cast<const T *>(row), vb / static_cast<int64_t>(sizeof(T)), lane);
    }
}

template <int N>
__global__ void init_kernel(const __grid_constant__ Group<tf_dynemb_init_params, N> g) {
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

/* The optimizer's step on one element of a row: returns the new weight; s1 / s2 are the element's
 * state (Adagrad: s1; Adam: s1, s2), updated. rw_mult: RowWiseAdagrad's step (rowwise_mult). */
__device__ __forceinline__ float opt_step(const tf_dynemb_update_params &p, int opt, float w, float g, float &s1,
                                          float &s2, float rw_mult) {
    switch (opt) {
    case TF_OPT_SGD: return w - p.lr * g;
    case TF_OPT_ADAGRAD: s1 = s1 + g * g; return w - p.lr * g / (sqrtf(s1) + p.eps);
    case TF_OPT_ROWWISE_ADAGRAD: return w - rw_mult * g;
    default: {  // Adam, in torch.optim.SparseAdam's form
        const float m = s1 + (g - s1) * (1.f - p.beta1);
        const float v = s2 + (g * g - s2) * (1.f - p.beta2);
        s1 = m;
        s2 = v;
        return w + -p.step_size * (m / (sqrtf(v) + p.eps));
    }
    }
}

/* RowWiseAdagrad: sq is this lane's sum of its columns' squared gradients; the warp's total over the
 * row updates the row's one state float (the running mean square) and gives lr / (sqrt(m) + eps). */
__device__ __forceinline__ float rowwise_mult(const tf_dynemb_update_params &p, float *st, float sq, int lane) {
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    const float m = st[0] + sq / static_cast<float>(p.dim);
    __syncwarp();
    if (lane == 0) st[0] = m;
    return p.lr / (sqrtf(m) + p.eps);
}

__device__ __forceinline__ void update_one(const tf_dynemb_update_params &p, int64_t i, int lane) {
    const int64_t slot = p.slots[i];
    if (slot < 0) return;
    const int64_t dim = p.dim;
    char *row = tf_dynemb_row(&p.values, slot);
    float *st = p.state.row_bytes ? reinterpret_cast<float *>(tf_dynemb_row(&p.state, slot)) : nullptr;
    const int64_t g0 = i * p.grad_stride;
    float rw_mult = 0.f;
    if (p.opt == TF_OPT_ROWWISE_ADAGRAD) {
        float sq = 0.f;
        for (int64_t j = lane; j < dim; j += 32) {
            const float g = load_f32(p.grad, p.grad_dtype, g0 + j);
            sq += g * g;
        }
        rw_mult = rowwise_mult(p, st, sq, lane);
    }
    // Four elements per lane at a time, every load issued before the first store (the compiler may
    // not move a load above a store that could alias it: one round trip per element otherwise).
    const bool st1 = p.opt == TF_OPT_ADAGRAD || p.opt == TF_OPT_ADAM, st2 = p.opt == TF_OPT_ADAM;
    for (int64_t j0 = lane; j0 < dim; j0 += 4 * 32) {
        float g[4], w[4], s1[4], s2[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int64_t j = j0 + 32 * k;
            g[k] = w[k] = s1[k] = s2[k] = 0.f;
            if (j < dim) {
                g[k] = load_f32(p.grad, p.grad_dtype, g0 + j);
                w[k] = load_f32(row, p.dtype, j);
                if (st1) s1[k] = st[j];
                if (st2) s2[k] = st[dim + j];
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int64_t j = j0 + 32 * k;
            if (j >= dim) break;
            w[k] = opt_step(p, p.opt, w[k], g[k], s1[k], s2[k], rw_mult);
            if (st1) st[j] = s1[k];
            if (st2) st[dim + j] = s2[k];
            store_f32(row, p.dtype, j, w[k]);
        }
    }
}

template <int N>
__global__ void update_kernel(const __grid_constant__ Group<tf_dynemb_update_params, N> g) {
    warp_item(g, [](const tf_dynemb_update_params &a, int64_t i, int lane) { update_one(a, i, lane); });
}

// ---- find-or-insert in two kernels (tf_dynemb_foi_params) ----

// The 32 lanes copy a row of row_bytes in units of T.
template <typename T>
__device__ __forceinline__ void copy_row(void *dst, const void *src, int64_t row_bytes, int lane) {
    copy_units<T, 32>(static_cast<T *>(dst), static_cast<const T *>(src), row_bytes / static_cast<int64_t>(sizeof(T)), lane);
}

__device__ __forceinline__ void touch_slot(const tf_dynemb_table &t, int policy, int64_t clock, int64_t slot) {
    if (policy == TF_DYNEMB_LFU) atomicAdd(reinterpret_cast<unsigned long long *>(&t.scores[slot]), 1ull);
    else if (policy == TF_DYNEMB_LRU) t.scores[slot] = clock;
}

/* Step 1, a warp per key: probe; a found key's slot is marked with the epoch (so step 2's evictions
 * spare it), touched, and its row copied out. Misses get slot -1. Step 2 starts after every mark is
 * written, which one kernel could not promise. */
template <typename T>
__global__ void foi_find_kernel(tf_dynemb_table t, tf_dynemb_foi_params p) {
    const int64_t i = warp_index();
    const int lane = threadIdx.x & 31;
    if (i >= foi_count(p)) {
        // past n_valid, or aborted: defined, as the pool op queued before the host's wait reads
        // every slot (the 128-slot kernel does the same)
        if (lane == 0 && i < p.p.n) p.p.slots[i] = -1;
        return;
    }
    int64_t found;
    const unsigned m = warp_probe(t, p.p.query[i], lane, found);
    const int64_t slot = m ? __shfl_sync(0xffffffffu, found, __ffs(m) - 1) : -1;
    if (lane == 0) {
        p.p.slots[i] = slot;
        if (slot >= 0) {
            t.marks[slot] = p.p.epoch;
            touch_slot(t, p.policy, p.clock, slot);
        }
    }
    if (slot >= 0 && p.out)
        copy_row<T>(static_cast<char *>(p.out) + i * p.init.values.row_bytes, tf_dynemb_row(&p.init.values, slot),
                    p.init.values.row_bytes, lane);
}

/* Step 2's insert, lock-free: a key known to be absent (step 1 ran; the keys of a call are distinct)
 * claims a slot by swapping the slot's mark to the epoch with atomicCAS. Empty-slot takers and
 * evictors both must win that swap, so each slot goes to one key, and a slot marked by this call
 * (found in step 1, or claimed) is never taken. Each attempt takes the bucket's lowest empty unmarked
 * slot, else (allow_evict) its unmarked slot of least (score, slot), as the locked insert does; a lost
 * swap means another key progressed, and the warp looks again. Writes slots[i], is_new, counts and
 * the evicted arrays; returns the eviction index (or -1) to every lane. */
__device__ __forceinline__ int64_t claim_one(const tf_dynemb_table &t, const tf_dynemb_probe &p, int64_t i,
                                             int lane) {
    const int64_t key = p.query[i];
    const uint64_t h = tf_dynemb_hash(key);
    const int64_t base = tf_dynemb_bucket(h, t.num_buckets) * t.bucket_size;
    const uint32_t d = tf_dynemb_digest(h);
    const bool active = lane < (t.bucket_size >> 2);
    // Keys of one bucket start their search for an empty slot at different places (from hash bits
    // the bucket index does not use), so concurrent claimers rarely race for the same slot.
    const int64_t rot = static_cast<int64_t>((h >> 40) & static_cast<uint64_t>(t.bucket_size - 1));
    for (;;) {
        int64_t order = INT64_MAX, vs = 0, vj = -1;
        int32_t em = 0, vm = 0;
        uint32_t w = 0;
        if (active) {
            w = __ldcg(reinterpret_cast<const uint32_t *>(t.digests + base) + lane);
            for (int b = 0; b < 4; ++b) {
                if ((w >> (8 * b)) & 0xffu) continue;
                const int64_t j = base + 4 * lane + b;
                const int32_t m = __ldcg(&t.marks[j]);
                const int64_t o = (j - base - rot) & (t.bucket_size - 1);
                if (m != p.epoch && o < order) { order = o; em = m; }
            }
        }
        int64_t best_order = order;
        for (int o = 16; o > 0; o >>= 1) best_order = min(best_order, __shfl_xor_sync(0xffffffffu, best_order, o));
        const int64_t best = best_order == INT64_MAX ? INT64_MAX : base + ((best_order + rot) & (t.bucket_size - 1));
        if (best == INT64_MAX && p.allow_evict && active) {  // full: victims need marks and scores
            for (int b = 0; b < 4; ++b) {
                if (((w >> (8 * b)) & 0xffu) == 0) continue;
                const int64_t j = base + 4 * lane + b;
                const int32_t m = __ldcg(&t.marks[j]);
                if (m == p.epoch) continue;
                const int64_t pj = vj;
                min_victim(vs, vj, __ldcg(&t.scores[j]), j);
                if (vj != pj) vm = m;
            }
        }
        int64_t slot = -1, e = -1;
        if (best != INT64_MAX) {
            const int owner = static_cast<int>((best - base) >> 2);
            bool won = false;
            if (lane == owner) won = atomicCAS(&t.marks[best], em, p.epoch) == em;
            if (!__shfl_sync(0xffffffffu, won, owner)) continue;
            slot = best;
        } else {
            // the least (score, slot) victim over the lanes, and the lane holding it
            int64_t bs = vs, bj = vj;
            for (int o = 16; o > 0; o >>= 1) {
                const int64_t s2 = __shfl_xor_sync(0xffffffffu, bs, o), j2 = __shfl_xor_sync(0xffffffffu, bj, o);
                min_victim(bs, bj, s2, j2);
            }
            if (bj < 0) {  // nothing to take: full of this call's keys, or no eviction
                if (lane == 0) atomicAdd(reinterpret_cast<unsigned long long *>(&p.counts[2]), 1ull);
                return -1;
            }
            const int owner = static_cast<int>((bj - base) >> 2);
            bool won = false;
            if (lane == owner) won = atomicCAS(&t.marks[bj], vm, p.epoch) == vm;
            if (!__shfl_sync(0xffffffffu, won, owner)) continue;
            slot = bj;
            if (lane == 0) {
                e = static_cast<int64_t>(atomicAdd(reinterpret_cast<unsigned long long *>(&p.counts[1]), 1ull));
                p.evicted_keys[e] = __ldcg(&t.keys[slot]);
                p.evicted_slots[e] = slot;
                p.evicted_scores[e] = bs;
            }
            e = __shfl_sync(0xffffffffu, e, 0);
        }
        if (lane == 0) {
            t.keys[slot] = key;
            t.scores[slot] = 0;
            t.digests[slot] = static_cast<uint8_t>(d);
            p.slots[i] = slot;
            p.is_new[i] = 1;
            atomicAdd(reinterpret_cast<unsigned long long *>(&p.counts[0]), 1ull);
        }
        return e;
    }
}

/* Step 2, a warp per missing key: claim_one, then the new row from the initializer, the touch, and
 * the row copied out. A key that evicted another leaves its row alone when keep_victims (the caller
 * saves the victim's row first, then initializes: evicted_new[e] = i). */
template <typename T>
__global__ void foi_insert_kernel(tf_dynemb_table t, tf_dynemb_foi_params p) {
    const int64_t i = warp_index();
    const int lane = threadIdx.x & 31;
    if (i >= foi_count(p) || p.p.slots[i] >= 0) return;  // uniform per warp
    const int64_t e = claim_one(t, p.p, i, lane);
    __syncwarp();
    const int64_t slot = p.p.slots[i];
    if (slot < 0) return;  // no room: counted as failed
    if (lane == 0) touch_slot(t, p.policy, p.clock, slot);
    if (e >= 0) {
        if (lane == 0) p.evicted_new[e] = i;
        if (p.keep_victims) return;
    }
    init_one(p.init, i, lane);
    __syncwarp();
    if (p.out)
        copy_row<T>(static_cast<char *>(p.out) + i * p.init.values.row_bytes, tf_dynemb_row(&p.init.values, slot),
                    p.init.values.row_bytes, lane);
}

/* Step 2 for 128-slot buckets: quarter warp q of a warp claims a slot for one missing key of step 1's
 * list (list_misses), as claim_one does but with 8 lanes of 16 slots each, and with atomicExch on the
 * mark: a claimer wins iff the mark was not yet the epoch, so it need not read the mark first. The
 * first attempt takes the slot step 1 chose (`first`, 255: none); only if another key won it does the
 * quarter read the bucket. Every attempt takes the first free slot in hash-rotated order, skipping
 * slots this quarter lost a swap for (their digests are written just after the swap, and may still
 * read 0), else (allow_evict) the unmarked slot of least (score, slot). qmask: the quarter's lanes. */
struct Claim {
    int64_t slot;        // -1: no room
    int64_t victim_key;  // when evicted
    int64_t victim_score;
    bool evicted;
};

// The empty-slot part of quarter_claim: the claimed slot, or -1 when the bucket is full.
__device__ __forceinline__ int64_t quarter_claim_free(const tf_dynemb_table &t, int32_t epoch, int64_t key, int first,
                                                      unsigned qmask, int q, int ql) {
    const uint64_t h = tf_dynemb_hash(key);
    const int64_t base = tf_dynemb_bucket(h, t.num_buckets) * 128;
    const int rot = insert_rotation(h);
    unsigned lost = 0;  // bit k: slot base + 16 ql + k was taken by another key under this quarter's eyes
    if (first < 128) {  // step 1's choice: no read needed unless another key took it meanwhile
        const int owner = first >> 4;
        bool won = false;
        if (ql == owner) {
            won = atomicExch(&t.marks[base + first], epoch) != epoch;
            if (!won) lost |= 1u << (first & 15);
        }
        if (__shfl_sync(qmask, won, 8 * q + owner)) return base + first;
    }
    for (;;) {
        const uint4 w4 = __ldcg(reinterpret_cast<const uint4 *>(t.digests + base) + ql);
        const uint32_t ws[4] = {w4.x, w4.y, w4.z, w4.w};
        int order = quarter_free_order(ws, ql, rot, lost);
        for (int o = 4; o > 0; o >>= 1) order = min(order, __shfl_xor_sync(qmask, order, o));
        if (order < 128) {
            const int s = (order + rot) & 127, owner = s >> 4;
            bool won = false;
            if (ql == owner) {
                won = atomicExch(&t.marks[base + s], epoch) != epoch;
                if (!won) lost |= 1u << (s & 15);
            }
            if (__shfl_sync(qmask, won, 8 * q + owner)) return base + s;
            continue;
        }
        return -1;  // full: no slot frees up during a call
    }
}

__device__ __forceinline__ Claim quarter_claim(const tf_dynemb_table &t, const tf_dynemb_probe &p, int64_t key,
                                               int first, unsigned qmask, int q, int ql) {
    const int64_t free_slot = quarter_claim_free(t, p.epoch, key, first, qmask, q, ql);
    if (free_slot >= 0) return Claim{free_slot, 0, 0, false};
    if (!p.allow_evict) return Claim{-1, 0, 0, false};
    const int64_t base = tf_dynemb_bucket(tf_dynemb_hash(key), t.num_buckets) * 128;
    // The unmarked slot of least (score, slot). Scores are read once: the keys of a bucket all want its
    // least victim, and a quarter that loses one takes the next from what it read (a stale entry only
    // costs a lost swap), instead of reading 128 scores again. The marks need not be read: the
    // atomicExch below refuses a marked slot, and the slots this call marked rarely hold the least
    // score (under LRU they hold the newest); not reading them saves 512 bytes of loads per key.
    int64_t sc[16];
    unsigned eligible = 0xffffu;  // bit k: slot j0 + k not yet lost to another quarter
    const int64_t j0 = base + 16 * ql;
#pragma unroll
    for (int k = 0; k < 16; ++k) sc[k] = __ldcg(&t.scores[j0 + k]);
    for (;;) {
        int64_t vs = 0, vj = -1;
#pragma unroll
        for (int k = 0; k < 16; ++k)
            if ((eligible >> k) & 1u) min_victim(vs, vj, sc[k], j0 + k);
        for (int o = 4; o > 0; o >>= 1) {
            const int64_t s2 = __shfl_xor_sync(qmask, vs, o), j2 = __shfl_xor_sync(qmask, vj, o);
            min_victim(vs, vj, s2, j2);
        }
        if (vj < 0) return Claim{-1, 0, 0, false};  // full of this call's keys
        const int owner = static_cast<int>((vj - base) >> 4);
        bool won = false;
        int64_t vkey = 0;
        if (ql == owner) {
            won = atomicExch(&t.marks[vj], p.epoch) != p.epoch;
            if (won) vkey = __ldcg(&t.keys[vj]);
            else eligible &= ~(1u << (vj - j0));
        }
        if (__shfl_sync(qmask, won, 8 * q + owner))
            return Claim{vj, __shfl_sync(qmask, vkey, 8 * q + owner), vs, true};
    }
}

/* A new key's table entry in a slot its quarter claimed (the mark is already the epoch): key, score
 * (new, and touched) and digest. Step 1's probes run alongside and may see the digest before the key:
 * no fence is needed, as the key they would read instead is the slot's vacant key (dynemb_kernels.h), which
 * no probe of this bucket can match. */
__device__ __forceinline__ void place_key(const tf_dynemb_table &t, int policy, int64_t clock, int64_t slot, int64_t key) {
    t.keys[slot] = key;
    t.scores[slot] = policy == TF_DYNEMB_LRU ? clock : policy == TF_DYNEMB_LFU ? 1 : 0;
    t.digests[slot] = static_cast<uint8_t>(tf_dynemb_digest(tf_dynemb_hash(key)));
}

// A new key's row from the initializer (and to the output `o` from registers, when not NULL), its
// optimizer state zeroed; the 8 lanes of a quarter.
template <typename T>
__device__ __forceinline__ void quarter_new_row(const tf_dynemb_init_params &in, int64_t slot, int64_t key, char *o, int ql) {
    char *row = tf_dynemb_row(&in.values, slot);
    if (in.init_kind != TF_INIT_NONE) {
        for (int64_t j = ql; j < in.dim; j += 8) {
            const float v = static_cast<float>(tf_dynemb_init_value(in.init_kind, in.a, in.b, key, in.seed, j));
            store_f32(row, in.dtype, j, v);
            if (o) store_f32(o, in.dtype, j, v);
        }
    } else if (o) {  // no initializer: the slot keeps whatever row it had
        copy_units<T, 8>(reinterpret_cast<T *>(o), reinterpret_cast<const T *>(row),
                         in.values.row_bytes / static_cast<int64_t>(sizeof(T)), ql);
    }
    if (in.state.row_bytes) {
        float *st = reinterpret_cast<float *>(tf_dynemb_row(&in.state, slot));
        for (int64_t j = ql; j < in.state.row_bytes / 4; j += 8) st[j] = 0.f;
    }
}

/* Step 1 of find_or_insert for 128-slot buckets, four keys per warp (quarter q: key 4w+q). A found
 * key's slot is marked with the epoch, touched, and its row copied out. A missing key whose bucket
 * has an empty slot claims it here (quarter_claim_free) and gets its row from the initializer, so
 * step 2's list holds only the keys of full buckets, the ones that evict or fail: at load factors
 * below 1 step 2 has next to nothing to do. Evictions must wait for step 2: a victim is any unmarked
 * slot, and only after this kernel are all found slots marked. claim = 0 lists every missing key: the
 * two-step form, for tables of one bucket (the vacant-key rule, dynemb_kernels.h). */
template <typename T>
__global__ void __launch_bounds__(kBlock, 6) foi_probe_quarter_kernel(tf_dynemb_table t, tf_dynemb_foi_params p, int claim) {
    const int lane = threadIdx.x & 31, q = lane >> 3, ql = lane & 7;
    const int64_t i = warp_index() * 4 + q;  // every thread runs on to list_misses' barriers
    const bool valid = i < foi_count(p);
    const int64_t key = valid ? p.p.query[i] : 0;
    int order = 128;
    int64_t slot = quarter_probe(t, key, valid, q, ql, &order);
    const int rot = insert_rotation(tf_dynemb_hash(key));
    bool inserted = false;
    if (claim && valid && slot < 0 && order < 128) {
        slot = quarter_claim_free(t, p.p.epoch, key, (order + rot) & 127, 0xffu << (8 * q), q, ql);
        inserted = slot >= 0;
        order = 128;  // claimed, or the bucket filled up meanwhile: step 2 need not try a slot first
    }
    if (!valid && p.fill_outputs && ql == 0 && i < p.p.n) p.p.slots[i] = -1;  // past n_valid, or aborted: defined
    if (valid && ql == 0) {
        p.p.slots[i] = slot;
        if (p.fill_outputs) {  // coalesced: four consecutive keys per warp
            p.p.is_new[i] = inserted ? 1 : 0;
            if (p.p.evicted_keys)  // NULL: a caller keeping no evictions (keep_victims = 0) has no list
                p.p.evicted_keys[i] = p.p.evicted_slots[i] = p.p.evicted_scores[i] = p.evicted_new[i] = -1;
        } else if (inserted) {
            p.p.is_new[i] = 1;
        }
    }
    if (p.fill_outputs && blockIdx.x == 0 && threadIdx.x < 3) p.p.counts[threadIdx.x] = 0;
    list_misses(miss_list(p.miss, p.p.n), valid && slot < 0, inserted, key, i, order, rot);
    if (valid && slot >= 0) {  // else step 2 inserts it and writes its row
        char *o = p.out ? static_cast<char *>(p.out) + i * p.init.values.row_bytes : nullptr;
        if (inserted) {
            if (ql == 0) place_key(t, p.policy, p.clock, slot, key);
            quarter_new_row<T>(p.init, slot, key, o, ql);
        } else {
            if (ql == 0) {
                t.marks[slot] = p.p.epoch;
                touch_slot(t, p.policy, p.clock, slot);
            }
            if (o)
                copy_units<T, 8>(reinterpret_cast<T *>(o), reinterpret_cast<const T *>(tf_dynemb_row(&p.init.values, slot)),
                                 p.init.values.row_bytes / static_cast<int64_t>(sizeof(T)), ql);
        }
    }
}

/* The last block of step 2 to finish hands the counts to the host (tf_dynemb_foi_params.host_counts):
 * every block's count atomics precede its arrival on `done`, so the last one reads final counts. The
 * sequence word goes last, behind a system-wide fence, so a host that sees it reads complete counts. */
__device__ __forceinline__ void foi_counts_to_host(const tf_dynemb_foi_params &p, const MissList &ml,
                                                   unsigned long long *counts) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    __threadfence();
    if (atomicAdd(ml.done, 1ull) != gridDim.x - 1) return;
    __threadfence();
    volatile int64_t *h = p.host_counts;
    for (int k = 0; k < 3; ++k) h[k] = static_cast<int64_t>(atomicAdd(&counts[k], 0ull));
    h[3] = p.n_valid ? *reinterpret_cast<const volatile int64_t *>(p.n_valid) : p.p.n;
    h[4] = p.abort ? *reinterpret_cast<const volatile uint8_t *>(p.abort) : 0;
    __threadfence_system();
    h[5] = p.host_seq;
}

/* Step 2 for 128-slot buckets: a resident grid walks step 1's list of misses, 32 keys per block per
 * round, a quarter warp each: quarter_claim, then the key, digest and score written, the row
 * initialized and, when asked, written out too (from registers, not read back). Evictions and the
 * counts are numbered with one global atomic per block and round. An evicting key leaves its row to
 * the caller (evicted_new) when keep_victims; otherwise it gets its row here like any new key. */
template <typename T>
__global__ void __launch_bounds__(kBlock, 4) foi_insert_quarter_kernel(tf_dynemb_table t, tf_dynemb_foi_params p) {
    __shared__ int ev_prefix[kWarpsPerBlock];
    __shared__ int fail_count[kWarpsPerBlock];
    __shared__ int64_t ev_base;
    const int lane = threadIdx.x & 31, q = lane >> 3, ql = lane & 7, w = threadIdx.x >> 5;
    const MissList ml = miss_list(p.miss, p.p.n);
    const int64_t count = static_cast<int64_t>(*ml.count);
    unsigned long long *counts = reinterpret_cast<unsigned long long *>(p.p.counts);
    if (blockIdx.x == 0 && threadIdx.x == 0 && *ml.inserted) atomicAdd(&counts[0], *ml.inserted);
    for (int64_t r0 = 32 * static_cast<int64_t>(blockIdx.x); r0 < count; r0 += 32 * static_cast<int64_t>(gridDim.x)) {
        const int64_t k = r0 + 4 * w + q;  // uniform per block: the loop and the barriers in it
        const bool valid = k < count;
        int64_t key = 0, i = 0;
        int first = 255;
        if (valid) {  // independent loads: one round trip
            key = ml.keys[k];
            i = ml.index[k];
            first = ml.first[k];
        }
        Claim c{-1, 0, 0, false};
        if (valid) c = quarter_claim(t, p.p, key, first, 0xffu << (8 * q), q, ql);
        __syncwarp();
        const unsigned eb = __ballot_sync(0xffffffffu, c.evicted && ql == 0);
        const unsigned fb = __ballot_sync(0xffffffffu, valid && c.slot < 0 && ql == 0);
        const unsigned vb = __ballot_sync(0xffffffffu, valid && ql == 0);
        if (lane == 0) {
            ev_prefix[w] = __popc(eb);
            fail_count[w] = __popc(fb) | (__popc(vb) << 8);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int ne = 0, nf = 0, nv = 0;
            for (int x = 0; x < kWarpsPerBlock; ++x) {
                const int c1 = ev_prefix[x];
                ev_prefix[x] = ne;
                ne += c1;
                nf += fail_count[x] & 0xff;
                nv += fail_count[x] >> 8;
            }
            ev_base = ne ? static_cast<int64_t>(atomicAdd(&counts[1], static_cast<unsigned long long>(ne))) : 0;
            if (nv > nf) atomicAdd(&counts[0], static_cast<unsigned long long>(nv - nf));
            if (nf) atomicAdd(&counts[2], static_cast<unsigned long long>(nf));
        }
        __syncthreads();
        if (c.slot < 0) continue;  // invalid, or no room (counted as failed)
        const int64_t slot = c.slot;
        if (ql == 0) {
            if (c.evicted && p.p.evicted_keys) {
                const int64_t e = ev_base + ev_prefix[w] + __popc(eb & ((1u << (8 * q)) - 1u));
                p.p.evicted_keys[e] = c.victim_key;
                p.p.evicted_slots[e] = slot;
                p.p.evicted_scores[e] = c.victim_score;
                p.evicted_new[e] = i;
            }
            place_key(t, p.policy, p.clock, slot, key);
            p.p.slots[i] = slot;
            p.p.is_new[i] = 1;
        }
        if (c.evicted && p.keep_victims) continue;  // the caller saves the victim's row first
        quarter_new_row<T>(p.init, slot, key, p.out ? static_cast<char *>(p.out) + i * p.init.values.row_bytes : nullptr, ql);
    }
    if (p.host_counts) foi_counts_to_host(p, ml, counts);
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
                acc.x += wk * v.x;
                acc.y += wk * v.y;
                acc.z += wk * v.z;
                acc.w += wk * v.w;
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
                if (j < p.dim) acc[k] += p.weights ? w * load_f32(row, p.dtype, j) : load_f32(row, p.dtype, j);
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
__global__ void pool_kernel(const __grid_constant__ Group<tf_dynemb_pool_params, N> g) {
    warp_item(g, [](const tf_dynemb_pool_params &a, int64_t b, int lane) { pool_one(a, b, lane); });
}

/* Segment sum in two steps (see tf_dynemb_segsum_params). Step 1: one warp per chunk of
 * TF_DYNEMB_SEG_CHUNK consecutive occurrences (perm order), lanes over columns. The lanes first load
 * the chunk's (source row, scale) pairs, one per lane, then walk the occurrences in order, taking each
 * pair from its lane by shuffle, so a step costs one row load instead of three dependent loads.
 * A run of one id that lies wholly inside the chunk is written to out; a run cut by the chunk's
 * edge is written to partial: slot 0 when the id began in an earlier chunk, slot 1 when it begins
 * here and goes on. */
// ---- segment sum: shared pieces of the chunk kernels ----

// Occurrences [q0, q1) of chunk k (q0 < n_occ checked by the caller).
__device__ __forceinline__ int64_t seg_chunk_end(const tf_dynemb_segsum_params &p, int64_t q0) {
    return q0 + TF_DYNEMB_SEG_CHUNK < p.n_occ ? q0 + TF_DYNEMB_SEG_CHUNK : p.n_occ;
}

// The id of occurrence q: the last u with seg[u] <= q. Warp-collective (all 32 lanes, the same q):
// each round the lanes probe 32 evenly spaced ids of the range left and keep the part between the
// last probe at or below q and the next, so a million ids take 4 dependent loads, not 20 (the
// chunk kernels' prologue, before any row is loaded, was a 20-load chain per warp).
__device__ __forceinline__ int64_t seg_id_of(const tf_dynemb_segsum_params &p, int64_t q, int lane) {
    int64_t lo = 0, hi = p.n_unique - 1;  // the answer lies in [lo, hi]; seg[lo] <= q
    while (lo < hi) {
        const int64_t step = (hi - lo + 32) / 32;  // ceil((hi - lo + 1) / 32) >= 1
        const int64_t pos = lo + (lane + 1) * step;
        // seg is non-decreasing, so the lanes whose probe is at or below q are a prefix
        const unsigned ok = __ballot_sync(0xffffffffu, pos <= hi && p.seg[pos] <= q);
        const int c = __popc(ok);
        const int64_t next_lo = lo + c * step;
        hi = next_lo + step - 1 < hi ? next_lo + step - 1 : hi;
        lo = next_lo;
    }
    return lo;
}

// Lane l's (source row, scale) of occurrence q0 + l, handed round by shuffle as the chunk is walked.
__device__ __forceinline__ void seg_lane_pair(const tf_dynemb_segsum_params &p, int64_t q0, int64_t q1, int lane,
                                              int64_t &src, float &scale) {
    src = 0;
    scale = 0.f;
    if (q0 + lane < q1) {
        const int64_t i = p.perm[q0 + lane];
        src = p.bag_of ? p.bag_of[i] : i;
        scale = p.scale ? p.scale[i] : 1.f;
    }
}

/* The id whose run chunk k (occurrences [q0, q1)) must join, or -1: the run of its last occurrence,
 * when it begins in this chunk and goes on past it; *k1 = the chunk where that run ends. */
__device__ __forceinline__ int64_t seg_cut_run(const tf_dynemb_segsum_params &p, int64_t q0, int64_t q1, int lane,
                                               int64_t *k1) {
    const int64_t u = seg_id_of(p, q1 - 1, lane);
    const int64_t a = p.seg[u], b = p.seg[u + 1];
    if (a < q0 || b <= q1) return -1;  // began in an earlier chunk (joined there), or ends in this one
    *k1 = (b - 1) / TF_DYNEMB_SEG_CHUNK;
    return u;
}

// The run's gradient at column c: its first chunk's slot-1 sum, then each later chunk's slot 0, in order.
__device__ __forceinline__ float seg_joined(const tf_dynemb_segsum_params &p, int64_t k, int64_t k1, int64_t c) {
    float acc = p.partial[(2 * k + 1) * p.dim + c];
    for (int64_t kk = k + 1; kk <= k1; ++kk) acc += p.partial[(2 * kk) * p.dim + c];
    return acc;
}

// Columns per lane per pass over a chunk (a pass covers 32 kSegCols columns; wider rows take more).
constexpr int kSegCols = 4;

__global__ void segsum_chunk_kernel(tf_dynemb_segsum_params p) {
    const int64_t k = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t q0 = k * TF_DYNEMB_SEG_CHUNK;
    if (q0 >= p.n_occ) return;
    const int64_t q1 = seg_chunk_end(p, q0);
    int64_t my_src;
    float my_scale;
    seg_lane_pair(p, q0, q1, lane, my_src, my_scale);
    const int64_t lo = seg_id_of(p, q0, lane);
    for (int64_t c0 = 0; c0 < p.dim; c0 += 32 * kSegCols) {
        float acc[kSegCols];
#pragma unroll
        for (int j = 0; j < kSegCols; ++j) acc[j] = 0.f;
        int64_t u = lo, u_begin = p.seg[u], u_end = p.seg[u + 1];
        // Four occurrences' rows are loaded before any is summed: runs are mostly one occurrence
        // long, and a run's store would otherwise hold back the next row's load.
        for (int64_t qb = q0; qb < q1; qb += 4) {
            float v[4][kSegCols];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int64_t q = qb + r;
                const int64_t src = __shfl_sync(0xffffffffu, my_src, (int)((q < q1 ? q : q0) - q0));
#pragma unroll
                for (int j = 0; j < kSegCols; ++j) {
                    const int64_t c = c0 + lane + 32 * j;
                    v[r][j] = q < q1 && c < p.dim ? load_f32(p.grad, p.grad_dtype, src * p.dim + c) : 0.f;
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int64_t q = qb + r;
                if (q >= q1) break;
                const float s = __shfl_sync(0xffffffffu, my_scale, (int)(q - q0));
#pragma unroll
                for (int j = 0; j < kSegCols; ++j) acc[j] += s * v[r][j];
                if (q + 1 == u_end || q + 1 == q1) { /* the run of id u ends here */
                    float *dst;
                    if (u_begin >= q0 && u_end <= q1) dst = p.out + u * p.dim;
                    else dst = p.partial + ((2 * k + (u_begin < q0 ? 0 : 1)) * p.dim);
#pragma unroll
                    for (int j = 0; j < kSegCols; ++j) {
                        const int64_t c = c0 + lane + 32 * j;
                        if (c < p.dim) dst[c] = acc[j];
                        acc[j] = 0.f;
                    }
                    if (q + 1 < q1 && u + 1 < p.n_unique) { /* the next id begins at q + 1 (unique ids own non-empty runs) */
                        ++u;
                        u_begin = u_end;
                        u_end = p.seg[u + 1];
                    }
                }
            }
        }
    }
}

/* Step 2: the ids whose run crosses a chunk edge, one warp per chunk: the chunk where such a run
 * begins adds its slot-1 sum and each later chunk's slot-0 sum, in chunk order, into out. (A warp per
 * unique id cost ~120 us at a million ids, nearly all of them finished by step 1.) */
__global__ void segsum_join_kernel(tf_dynemb_segsum_params p) {
    const int64_t k = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t q0 = k * TF_DYNEMB_SEG_CHUNK;
    if (q0 >= p.n_occ) return;
    int64_t k1;
    const int64_t u = seg_cut_run(p, q0, seg_chunk_end(p, q0), lane, &k1);
    if (u < 0) return;
    for (int64_t c = lane; c < p.dim; c += 32) p.out[u * p.dim + c] = seg_joined(p, k, k1, c);
}

/* Ids with an empty run (seg[u] == seg[u + 1]: not produced by unique ids, but defined) get zeros;
 * a thread per id. */
__global__ void segsum_empty_kernel(tf_dynemb_segsum_params p) {
    const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (u >= p.n_unique || p.seg[u + 1] > p.seg[u]) return;
    for (int64_t c = 0; c < p.dim; ++c) p.out[u * p.dim + c] = 0.f;
}

// ---- segment sum fused with the optimizer update (rows of at most 32 kSegCols columns) ----

// Row `slot`'s weights and state at this lane's columns lane + 32 k (zeros past the row).
template <int kOpt>
__device__ __forceinline__ void load_cols(const tf_dynemb_update_params &u, int64_t slot, int lane,
                                          float (&w)[kSegCols], float (&s1)[kSegCols], float (&s2)[kSegCols]) {
    const char *row = tf_dynemb_row(&u.values, slot);
    const float *st = u.state.row_bytes ? reinterpret_cast<const float *>(tf_dynemb_row(&u.state, slot)) : nullptr;
    constexpr bool st1 = kOpt == TF_OPT_ADAGRAD || kOpt == TF_OPT_ADAM, st2 = kOpt == TF_OPT_ADAM;
#pragma unroll
    for (int k = 0; k < kSegCols; ++k) {
        const int64_t j = lane + 32 * k;
        w[k] = s1[k] = s2[k] = 0.f;
        if (j < u.dim) {
            w[k] = load_f32(row, u.dtype, j);
            if (st1) s1[k] = st[j];
            if (st2) s2[k] = st[u.dim + j];
        }
    }
}

// One optimizer step of row `slot` with gradient g (this lane's columns), its row and state already
// in w / s1 / s2: the same arithmetic as update_one. The whole warp calls it. kOpt: u.opt, known at
// compile time so that SGD keeps no state registers.
template <int kOpt>
__device__ __forceinline__ void apply_cols(const tf_dynemb_update_params &u, int64_t slot, int lane,
                                           const float (&g)[kSegCols], float (&w)[kSegCols], float (&s1)[kSegCols],
                                           float (&s2)[kSegCols]) {
    char *row = tf_dynemb_row(&u.values, slot);
    float *st = u.state.row_bytes ? reinterpret_cast<float *>(tf_dynemb_row(&u.state, slot)) : nullptr;
    float rw_mult = 0.f;
    if (kOpt == TF_OPT_ROWWISE_ADAGRAD) {
        float sq = 0.f;
#pragma unroll
        for (int k = 0; k < kSegCols; ++k)
            if (lane + 32 * k < u.dim) sq += g[k] * g[k];
        rw_mult = rowwise_mult(u, st, sq, lane);
    }
    constexpr bool st1 = kOpt == TF_OPT_ADAGRAD || kOpt == TF_OPT_ADAM, st2 = kOpt == TF_OPT_ADAM;
#pragma unroll
    for (int k = 0; k < kSegCols; ++k) {
        const int64_t j = lane + 32 * k;
        if (j >= u.dim) break;
        w[k] = opt_step(u, kOpt, w[k], g[k], s1[k], s2[k], rw_mult);
        if (st1) st[j] = s1[k];
        if (st2) st[u.dim + j] = s2[k];
        store_f32(row, u.dtype, j, w[k]);
    }
}

/* segsum_chunk_kernel with the update folded in: a run wholly inside the chunk is not written out but
 * applied to its row (u.slots[id]) at once. The lanes first load the chunk's ids' run ends and slots
 * (a chunk of 32 occurrences has at most 32 ids); each step of four occurrences loads, with their
 * gradient rows, the rows of the ids whose runs end in it, so a step waits for one round of loads,
 * not one per id (runs are mostly one occurrence long). Runs cut by the chunk's edges go to the
 * partial sums as in segsum_chunk_kernel, and segsum_update_join_kernel applies them. */
// Registers capped so that SGD and row-wise Adagrad (no per-column state) fit 5 blocks (20 warps)
// per SM and the others 4: the kernel waits on memory (each id's table row read, then written), and
// uncapped SGD took 98 registers, 4 blocks. No spills (ptxas -v).
template <int kOpt>
__global__ void __launch_bounds__(128, kOpt == TF_OPT_SGD || kOpt == TF_OPT_ROWWISE_ADAGRAD ? 5 : 4)
    segsum_update_kernel(tf_dynemb_segsum_params p, tf_dynemb_update_params u) {
    const int64_t k = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t q0 = k * TF_DYNEMB_SEG_CHUNK;
    if (q0 >= p.n_occ) return;
    const int64_t q1 = seg_chunk_end(p, q0);
    int64_t my_src;
    float my_scale;
    seg_lane_pair(p, q0, q1, lane, my_src, my_scale);
    const int64_t lo = seg_id_of(p, q0, lane);
    int64_t my_end = INT64_MAX, my_slot = -1;  // lane l: the end of the run of id lo + l, and its slot
    if (lo + lane < p.n_unique) {
        my_end = p.seg[lo + lane + 1];
        my_slot = u.slots[lo + lane];
    }
    float acc[kSegCols];
#pragma unroll
    for (int j = 0; j < kSegCols; ++j) acc[j] = 0.f;
    int r = 0;  // the current id is lo + r
    int64_t u_begin = p.seg[lo], u_end = __shfl_sync(0xffffffffu, my_end, 0);
    for (int64_t qb = q0; qb < q1; qb += 4) {
        // ids lo + r + b (b < 4) whose run lies in the chunk and ends in this step: their rows now
        float w[4][kSegCols], s1[4][kSegCols], s2[4][kSegCols];
        int64_t slot_b[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int rb = r + b < 31 ? r + b : 31;
            const int64_t end_b = __shfl_sync(0xffffffffu, my_end, rb);
            const int64_t begin_b = b == 0 ? u_begin : __shfl_sync(0xffffffffu, my_end, rb > 0 ? rb - 1 : 0);
            const int64_t sl = __shfl_sync(0xffffffffu, my_slot, rb);
            const bool mine = r + b < 32 && begin_b >= q0 && end_b <= q1 && end_b - 1 >= qb && end_b - 1 <= qb + 3;
            slot_b[b] = mine ? sl : -1;
            if (slot_b[b] >= 0) load_cols<kOpt>(u, slot_b[b], lane, w[b], s1[b], s2[b]);
        }
        float v[4][kSegCols];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            const int64_t q = qb + rr;
            const int64_t src = __shfl_sync(0xffffffffu, my_src, (int)((q < q1 ? q : q0) - q0));
#pragma unroll
            for (int j = 0; j < kSegCols; ++j) {
                const int64_t c = lane + 32 * j;
                v[rr][j] = q < q1 && c < p.dim ? load_f32(p.grad, p.grad_dtype, src * p.dim + c) : 0.f;
            }
        }
        const int r0 = r;
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            const int64_t q = qb + rr;
            if (q >= q1) break;
            const float sc = __shfl_sync(0xffffffffu, my_scale, (int)(q - q0));
#pragma unroll
            for (int j = 0; j < kSegCols; ++j) acc[j] += sc * v[rr][j];
            if (q + 1 == u_end || q + 1 == q1) { /* the run of id lo + r ends here */
                if (u_begin >= q0 && u_end <= q1) {
                    const int b = r - r0;  // < 4: at most four runs end in four occurrences
#pragma unroll
                    for (int bb = 0; bb < 4; ++bb)
                        if (bb == b && slot_b[bb] >= 0) apply_cols<kOpt>(u, slot_b[bb], lane, acc, w[bb], s1[bb], s2[bb]);
                } else {
                    float *dst = p.partial + ((2 * k + (u_begin < q0 ? 0 : 1)) * p.dim);
#pragma unroll
                    for (int j = 0; j < kSegCols; ++j)
                        if (lane + 32 * j < p.dim) dst[lane + 32 * j] = acc[j];
                }
#pragma unroll
                for (int j = 0; j < kSegCols; ++j) acc[j] = 0.f;
                if (q + 1 < q1 && lo + r + 1 < p.n_unique) {
                    ++r;
                    u_begin = u_end;
                    u_end = __shfl_sync(0xffffffffu, my_end, r < 32 ? r : 31);
                }
            }
        }
    }
}

/* segsum_join_kernel's sums of the runs cut by chunk edges, applied to their rows. */
template <int kOpt>
__global__ void segsum_update_join_kernel(tf_dynemb_segsum_params p, tf_dynemb_update_params u) {
    const int64_t k = warp_index();
    const int lane = threadIdx.x & 31;
    const int64_t q0 = k * TF_DYNEMB_SEG_CHUNK;
    if (q0 >= p.n_occ) return;
    int64_t k1;
    const int64_t id = seg_cut_run(p, q0, seg_chunk_end(p, q0), lane, &k1);
    if (id < 0 || u.slots[id] < 0) return;
    const int64_t slot = u.slots[id];
    float g[kSegCols], w[kSegCols], s1[kSegCols], s2[kSegCols];
#pragma unroll
    for (int j = 0; j < kSegCols; ++j) g[j] = lane + 32 * j < p.dim ? seg_joined(p, k, k1, lane + 32 * j) : 0.f;
    load_cols<kOpt>(u, slot, lane, w, s1, s2);
    apply_cols<kOpt>(u, slot, lane, g, w, s1, s2);
}

/* Ids with an empty run (not produced by unique ids, but defined): a step with a zero gradient, as
 * segment_sum's zeros then update would take. A thread per id: the check is all most ids need. */
template <int kOpt>
__global__ void segsum_update_empty_kernel(tf_dynemb_segsum_params p, tf_dynemb_update_params u) {
    const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (id >= p.n_unique || p.seg[id + 1] > p.seg[id] || u.slots[id] < 0) return;
    const int64_t slot = u.slots[id];
    char *row = tf_dynemb_row(&u.values, slot);
    float *st = u.state.row_bytes ? reinterpret_cast<float *>(tf_dynemb_row(&u.state, slot)) : nullptr;
    float rw_mult = 0.f;
    if (kOpt == TF_OPT_ROWWISE_ADAGRAD) {
        const float m = st[0] + 0.f / static_cast<float>(u.dim);
        st[0] = m;
        rw_mult = u.lr / (sqrtf(m) + u.eps);
    }
    for (int64_t j = 0; j < u.dim; ++j) {
        float s1 = kOpt == TF_OPT_ADAGRAD || kOpt == TF_OPT_ADAM ? st[j] : 0.f;
        float s2 = kOpt == TF_OPT_ADAM ? st[u.dim + j] : 0.f;
        store_f32(row, u.dtype, j, opt_step(u, kOpt, load_f32(row, u.dtype, j), 0.f, s1, s2, rw_mult));
        if (kOpt == TF_OPT_ADAGRAD || kOpt == TF_OPT_ADAM) st[j] = s1;
        if (kOpt == TF_OPT_ADAM) st[u.dim + j] = s2;
    }
}

}  // namespace

extern "C" {

int tf_dynemb_group_pool_cuda(const tf_dynemb_pool_params *p, const int64_t *start, int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return TF_GROUP_LAUNCH(tf_dynemb_pool_params, p, start, n_tables, pool_kernel, grid_for_warps, s);
}

int tf_dynemb_pool_cuda(const tf_dynemb_pool_params *p, void *stream) {
    const int64_t start[2] = {0, p->n_bags};
    return tf_dynemb_group_pool_cuda(p, start, 1, stream);
}

int tf_dynemb_segsum_cuda(const tf_dynemb_segsum_params *p, void *stream) {
    if (p->n_unique == 0) return 0;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (p->n_occ > 0) {
        segsum_chunk_kernel<<<grid_for_warps(tf_dynemb_seg_chunks(p->n_occ)), kBlock, 0, s>>>(*p);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return static_cast<int>(err);
    }
    if (p->n_occ > 0) segsum_join_kernel<<<grid_for_warps(tf_dynemb_seg_chunks(p->n_occ)), kBlock, 0, s>>>(*p);
    segsum_empty_kernel<<<grid_for_threads(p->n_unique), kBlock, 0, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
}

// Probe arguments of n_tables tables, paired for the kernels (at most TF_DYNEMB_GROUP_MAX per launch).
static int probe_group(bool insert, const tf_dynemb_table *t, const tf_dynemb_probe *p, const int64_t *start,
                       int n_tables, cudaStream_t s) {
    for (int c = 0; c < n_tables; c += TF_DYNEMB_GROUP_MAX) {
        ProbeArgs a[TF_DYNEMB_GROUP_MAX];
        const int k = n_tables - c < TF_DYNEMB_GROUP_MAX ? n_tables - c : TF_DYNEMB_GROUP_MAX;
        for (int j = 0; j < k; ++j) a[j] = ProbeArgs{t[c + j], p[c + j]};
        const int err = insert ? TF_GROUP_LAUNCH(ProbeArgs, a, start + c, k, insert_kernel, grid_for_warps, s)
                               : TF_GROUP_LAUNCH(ProbeArgs, a, start + c, k, lookup_kernel, grid_for_warps, s);
        if (err) return err;
    }
    return 0;
}

int tf_dynemb_group_lookup_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, const int64_t *start,
                                int n_tables, void *stream) {
    return probe_group(false, t, p, start, n_tables, static_cast<cudaStream_t>(stream));
}

int tf_dynemb_lookup_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, void *stream) {
    const int64_t start[2] = {0, p->n};
    return tf_dynemb_group_lookup_cuda(t, p, start, 1, stream);
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

int tf_dynemb_group_insert_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, const int64_t *start,
                                int n_tables, void *stream) {
    return probe_group(true, t, p, start, n_tables, static_cast<cudaStream_t>(stream));
}

int tf_dynemb_insert_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, void *stream) {
    const int64_t start[2] = {0, p->n};
    return tf_dynemb_group_insert_cuda(t, p, start, 1, stream);
}

int tf_dynemb_group_touch_cuda(int64_t *const *scores, const int64_t *slots, const int64_t *start, const int *policy,
                               const int64_t *clock, int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    for (int c = 0; c < n_tables; c += TF_DYNEMB_GROUP_MAX) {
        TouchArgs a[TF_DYNEMB_GROUP_MAX];
        const int k = n_tables - c < TF_DYNEMB_GROUP_MAX ? n_tables - c : TF_DYNEMB_GROUP_MAX;
        for (int j = 0; j < k; ++j) a[j] = TouchArgs{scores[c + j], slots + start[c + j], policy[c + j], clock[c + j]};
        const int err = TF_GROUP_LAUNCH(TouchArgs, a, start + c, k, touch_kernel, grid_for_threads, s);
        if (err) return err;
    }
    return 0;
}

int tf_dynemb_touch_cuda(int64_t *scores, const int64_t *slots, int64_t n, int policy, int64_t clock, void *stream) {
    const int64_t start[2] = {0, n};
    return tf_dynemb_group_touch_cuda(&scores, slots, start, &policy, &clock, 1, stream);
}

int tf_dynemb_gather_cuda(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n, void *out,
                          void *stream) {
    return launch_rows(true, r, slots, order, n, out, static_cast<cudaStream_t>(stream));
}

int tf_dynemb_scatter_cuda(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n,
                           const void *src, void *stream) {
    return launch_rows(false, r, slots, order, n, const_cast<void *>(src), static_cast<cudaStream_t>(stream));
}

int tf_dynemb_group_init_cuda(const tf_dynemb_init_params *p, const int64_t *start, int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return TF_GROUP_LAUNCH(tf_dynemb_init_params, p, start, n_tables, init_kernel, grid_for_warps, s);
}

int tf_dynemb_evict_rows_cuda(const tf_dynemb_evict_params *p, void *stream) {
    if (p->n == 0) return 0;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool wide = copy_unit(&p->init.values, p->old_values) >= 16 &&
                      (p->rows_out == nullptr || copy_unit(&p->init.values, p->rows_out) >= 16);
    const bool narrow = p->init.values.row_bytes <= 128 && p->init.state.row_bytes <= 128;
    const unsigned g8 = grid_for_warps((p->n + 3) / 4);
    if (wide && narrow) evict_rows_kernel<uint4, 8><<<g8, kBlock, 0, s>>>(*p);
    else if (wide) evict_rows_kernel<uint4, 32><<<grid_for_warps(p->n), kBlock, 0, s>>>(*p);
    else evict_rows_kernel<uint8_t, 32><<<grid_for_warps(p->n), kBlock, 0, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
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
    return tf_dynemb_group_init_cuda(p, start, 1, stream);
}

int tf_dynemb_group_update_cuda(const tf_dynemb_update_params *p, const int64_t *start, int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return TF_GROUP_LAUNCH(tf_dynemb_update_params, p, start, n_tables, update_kernel, grid_for_warps, s);
}

int tf_dynemb_update_cuda(const tf_dynemb_update_params *p, void *stream) {
    const int64_t start[2] = {0, p->n};
    return tf_dynemb_group_update_cuda(p, start, 1, stream);
}

int tf_dynemb_segsum_update_cuda(const tf_dynemb_segsum_params *p, const tf_dynemb_update_params *u, void *stream) {
    if (p->n_unique == 0) return 0;
    if (p->dim > TF_DYNEMB_SEGSUM_UPDATE_MAX_DIM || TF_DYNEMB_SEGSUM_UPDATE_MAX_DIM > 32 * kSegCols)
        return static_cast<int>(cudaErrorInvalidValue);  // the glue takes two ops instead
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned grid = grid_for_warps(tf_dynemb_seg_chunks(p->n_occ));
    // 94-128 registers: blocks of 4 warps pack more warps per SM than blocks of 8
    const unsigned grid128 = static_cast<unsigned>((tf_dynemb_seg_chunks(p->n_occ) + 3) / 4);
#define TF_SEGUPD(OPT)                                                                           \
    if (p->n_occ > 0) {                                                                          \
        segsum_update_kernel<OPT><<<grid128, 128, 0, s>>>(*p, *u);                                \
        segsum_update_join_kernel<OPT><<<grid, kBlock, 0, s>>>(*p, *u);                           \
    }                                                                                            \
    segsum_update_empty_kernel<OPT><<<grid_for_threads(p->n_unique), kBlock, 0, s>>>(*p, *u);
    switch (u->opt) {
    case TF_OPT_SGD: TF_SEGUPD(TF_OPT_SGD) break;
    case TF_OPT_ADAGRAD: TF_SEGUPD(TF_OPT_ADAGRAD) break;
    case TF_OPT_ROWWISE_ADAGRAD: TF_SEGUPD(TF_OPT_ROWWISE_ADAGRAD) break;
    case TF_OPT_ADAM: TF_SEGUPD(TF_OPT_ADAM) break;
    default: return static_cast<int>(cudaErrorInvalidValue);
    }
#undef TF_SEGUPD
    return static_cast<int>(cudaGetLastError());
}

int tf_dynemb_find_or_insert_cuda(const tf_dynemb_table *t, const tf_dynemb_foi_params *p, void *stream) {
    if (p->p.n == 0) return 0;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned grid = grid_for_warps(p->p.n);
    const bool wide = copy_unit(&p->init.values, p->out) >= 16;
    if (t->bucket_size == 128) {  // four keys per warp; step 2 over step 1's list of misses
        // step 1 claims empty slots, except with one bucket (the vacant-key rule, dynemb_kernels.h)
        const int claim = t->num_buckets > 1;
        const unsigned g4 = grid_for_warps((p->p.n + 3) / 4);
        // step 2: one resident wave (4 blocks per SM by its launch bounds), or fewer for small batches
        const unsigned g2 = g4 < 4u * static_cast<unsigned>(sm_count()) ? g4 : 4u * static_cast<unsigned>(sm_count());
        // the list's count, step 1's inserts and step 2's finished blocks
        cudaError_t err = cudaMemsetAsync(p->miss, 0, tf_dynemb_foi_miss_zeroed, s);
        if (err != cudaSuccess) return static_cast<int>(err);
        if (wide) {
            foi_probe_quarter_kernel<uint4><<<g4, kBlock, 0, s>>>(*t, *p, claim);
            foi_insert_quarter_kernel<uint4><<<g2, kBlock, 0, s>>>(*t, *p);
        } else {
            foi_probe_quarter_kernel<uint16_t><<<g4, kBlock, 0, s>>>(*t, *p, claim);
            foi_insert_quarter_kernel<uint16_t><<<g2, kBlock, 0, s>>>(*t, *p);
        }
        return static_cast<int>(cudaGetLastError());
    }
    if (wide) {
        foi_find_kernel<uint4><<<grid, kBlock, 0, s>>>(*t, *p);
    } else {
        foi_find_kernel<uint16_t><<<grid, kBlock, 0, s>>>(*t, *p);
    }
    if (wide) foi_insert_kernel<uint4><<<grid, kBlock, 0, s>>>(*t, *p);
    else foi_insert_kernel<uint16_t><<<grid, kBlock, 0, s>>>(*t, *p);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
