/* CUDA side of kernels/dynemb_segments_kernels.h: a training batch's bag layout in one kernel, and its grouping
 * by id in three launches (flags, a CUB scan, one scatter), where ATen takes about a dozen each. The
 * GPU work is small (a few MB); what the launches cost is host time, which a training step from an
 * idle GPU waits for. */
#include <cuda_runtime.h>
#include <stdint.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "dynemb_kernels.h"
#include "dynemb_segments_kernels.h"

namespace {

constexpr int kThreads = 256;

template <typename Off>
__device__ __forceinline__ int64_t offset_at(const tf_dynemb_bag_layout_params &p, int64_t b) {
    return b >= p.n_in ? p.n : (int64_t)static_cast<const Off *>(p.offsets)[b];
}

/* Thread t: entry t of full (t <= n_bags) with its share of the flag, and id t (t < n): the last bag
 * b in [0, max(n_bags - 1, 0)] with offsets[b] <= t by binary search over the caller's offsets (read
 * through L1; the searches of a warp's consecutive ids walk the same path), then its mean scale. */
template <typename Off>
__global__ void bag_layout_kernel(tf_dynemb_bag_layout_params p) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t n_bags = p.include_last ? p.n_in - 1 : p.n_in;
    if (t <= n_bags) {
        const int64_t o = offset_at<Off>(p, t);
        p.full[t] = o;
        const bool bad = (t == 0 && o != 0) || (t > 0 && o < offset_at<Off>(p, t - 1)) || (t == n_bags && o != p.n);
        if (bad) *p.bad = 1;  // every writer writes 1: no ordering needed
    }
    if (t < p.n && p.bag_of) {
        int64_t lo = 0, hi = n_bags > 0 ? n_bags - 1 : 0;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo + 1) / 2;
            if (offset_at<Off>(p, mid) <= t) lo = mid; else hi = mid - 1;
        }
        p.bag_of[t] = lo;
        if (p.scale) {
            const int64_t len = n_bags > 0 ? offset_at<Off>(p, lo + 1) - offset_at<Off>(p, lo) : 0;
            p.scale[t] = 1.0f / (float)(len > 1 ? len : 1);
        }
    }
}

/* flags[j] = 1 where sorted position j starts a run of equal ids (j > 0), else 0; the inclusive scan
 * of it is then each position's index into uniq. */
__global__ void segment_flags_kernel(const int64_t *__restrict__ sorted, int64_t n, int32_t *__restrict__ flags) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) flags[j] = j > 0 && sorted[j] != sorted[j - 1];
}

/* Thread j (sorted position): inv[perm[j]] = run[j]; a run's first position writes its id and start;
 * positions at or past n_unique (= run[n - 1] + 1, the same address for every thread) fill the
 * tails: uniq[j] = sorted[j] and seg[j + 1] = n (j >= n_unique - 1). The writes never overlap. */
__global__ void segment_scatter_kernel(tf_dynemb_segments_params p) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= p.n) return;
    const int64_t nu = p.run[p.n - 1] + 1;
    const int64_t r = p.run[j];
    const int64_t id = p.sorted[j];
    int64_t src;
    if (p.perm) {
        src = p.perm[j];
    } else {  // the sort's int32 permutation, widened on the way
        src = p.perm32[j];
        p.perm_out[j] = src;
    }
    p.inv[src] = r;
    if (j == 0 || id != p.sorted[j - 1]) {
        p.uniq[r] = id;
        p.seg[r] = j;
    }
    if (j >= nu) p.uniq[j] = id;
    if (j >= nu - 1) p.seg[j + 1] = p.n;
    if (j == p.n - 1) *p.n_unique = nu;
}

/* The hash sort's keys (the top 32 bits of each id's hash) and the iota beside them. */
__global__ void hash_keys_kernel(const int64_t *__restrict__ ids, int64_t n, uint32_t *__restrict__ keys,
                                 int32_t *__restrict__ iota) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    keys[j] = (uint32_t)(tf_mix64((uint64_t)ids[j]) >> 32);
    iota[j] = (int32_t)j;
}

/* After the hash sort: each position's id (sorted[j] = ids[perm[j]]). */
__global__ void gather_ids_kernel(const int64_t *__restrict__ ids, const int32_t *__restrict__ perm, int64_t n,
                                  int64_t *__restrict__ sorted) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) sorted[j] = ids[perm[j]];
}

/* coll[j] = 1 where position j holds another id than j - 1 under the same hash key (a collision). */
__global__ void hash_collisions_kernel(const uint32_t *__restrict__ keys, const int64_t *__restrict__ sorted,
                                       int64_t n, int32_t *__restrict__ coll) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) coll[j] = j > 0 && keys[j] == keys[j - 1] && sorted[j] != sorted[j - 1];
}

/* Heap sort of positions [0, len) of (id, perm) pairs by id then perm: the perms are distinct, so this
 * order is the stable one (batch order within an id), in place and O(len log len) on one thread even
 * for a long run of distinct ids (an insertion sort would be quadratic there). */
__device__ void sort_run_by_id(int64_t *ids, int32_t *perm, int64_t len) {
    auto less = [&](int64_t a, int64_t b) { return ids[a] < ids[b] || (ids[a] == ids[b] && perm[a] < perm[b]); };
    auto swap = [&](int64_t a, int64_t b) {
        const int64_t x = ids[a];
        ids[a] = ids[b];
        ids[b] = x;
        const int32_t y = perm[a];
        perm[a] = perm[b];
        perm[b] = y;
    };
    auto sift = [&](int64_t root, int64_t end) {  // the heap [0, end) below root
        for (int64_t child; (child = 2 * root + 1) < end; root = child) {
            if (child + 1 < end && less(child, child + 1)) ++child;
            if (!less(root, child)) return;
            swap(root, child);
        }
    };
    for (int64_t i = len / 2; i-- > 0;) sift(i, len);
    for (int64_t end = len - 1; end > 0; --end) {
        swap(0, end);
        sift(0, end);
    }
}

/* A run of equal hash keys with a collision is put in id order, stably, by the thread of its first
 * collision, chosen from coll and the keys, which nothing here writes; every other position returns
 * after one load. Runs with a collision are rare and short (a pair of ids in a run of a few
 * occurrences), so one thread suffices. */
__global__ void hash_runs_fix_kernel(const uint32_t *__restrict__ keys, const int32_t *__restrict__ coll, int64_t n,
                                     int64_t *__restrict__ sorted, int32_t *__restrict__ perm) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n || !coll[j]) return;
    const uint32_t k = keys[j];
    int64_t r0 = j - 1;  // the run's start; an earlier collision of the run takes it instead
    while (r0 > 0 && keys[r0 - 1] == k) {
        if (coll[r0]) return;
        --r0;
    }
    int64_t r1 = j + 1;
    while (r1 < n && keys[r1] == k) ++r1;
    sort_run_by_id(sorted + r0, perm + r0, r1 - r0);
}

unsigned blocks_for(int64_t n) { return (unsigned)((n + kThreads - 1) / kThreads); }

}  // namespace

extern "C" int tf_dynemb_bag_layout_cuda(const tf_dynemb_bag_layout_params *p, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t n_bags = p->include_last ? p->n_in - 1 : p->n_in;
    if (n_bags < 0) return (int)cudaErrorInvalidValue;
    const int64_t ids = p->bag_of ? p->n : 0;
    const int64_t work = ids > n_bags + 1 ? ids : n_bags + 1;
    if (p->offsets_64)
        bag_layout_kernel<int64_t><<<blocks_for(work), kThreads, 0, s>>>(*p);
    else
        bag_layout_kernel<int32_t><<<blocks_for(work), kThreads, 0, s>>>(*p);
    return (int)cudaGetLastError();
}

extern "C" size_t tf_dynemb_segments_temp_bytes(int64_t n) {
    size_t bytes = 0;
    if (n > 0) cub::DeviceScan::InclusiveSum(nullptr, bytes, (const int32_t *)nullptr, (int64_t *)nullptr, (int)n);
    return bytes;
}

extern "C" int tf_dynemb_segments_cuda(const tf_dynemb_segments_params *p, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (p->n <= 0) return (int)cudaSuccess;  // the caller writes n_unique = 0 and seg = {0}
    if (p->n >= (int64_t{1} << 31)) return (int)cudaErrorInvalidValue;
    segment_flags_kernel<<<blocks_for(p->n), kThreads, 0, s>>>(p->sorted, p->n, p->flags);
    size_t bytes = p->temp_bytes;
    cudaError_t e = cub::DeviceScan::InclusiveSum(p->temp, bytes, (const int32_t *)p->flags, p->run, (int)p->n, s);
    if (e != cudaSuccess) return (int)e;
    segment_scatter_kernel<<<blocks_for(p->n), kThreads, 0, s>>>(*p);
    return (int)cudaGetLastError();
}

extern "C" size_t tf_dynemb_sort_temp_bytes(int64_t n) {
    size_t bytes = 0;
    if (n > 0)
        cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const uint32_t *)nullptr, (uint32_t *)nullptr,
                                        (const int32_t *)nullptr, (int32_t *)nullptr, (int)n);
    return bytes;
}

extern "C" int tf_dynemb_sort_segments_cuda(const tf_dynemb_sort_segments_params *p, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t n = p->g.n;
    if (n <= 0) return (int)cudaSuccess;
    if (n >= (int64_t{1} << 31)) return (int)cudaErrorInvalidValue;
    size_t bytes = p->sort_temp_bytes;
    cudaError_t e;
    // the hash keys in g.flags, sorted into g.run's first half (both free until the grouping)
    uint32_t *keys = reinterpret_cast<uint32_t *>(p->g.flags), *keys_sorted = reinterpret_cast<uint32_t *>(p->g.run);
    hash_keys_kernel<<<blocks_for(n), kThreads, 0, s>>>(p->ids, n, keys, p->iota);
    e = cub::DeviceRadixSort::SortPairs(p->sort_temp, bytes, keys, keys_sorted, p->iota, p->perm32, (int)n, 0, 32, s);
    if (e != cudaSuccess) return (int)e;
    gather_ids_kernel<<<blocks_for(n), kThreads, 0, s>>>(p->ids, p->perm32, n, p->sorted);
    // the collision flags in iota (free after the sort)
    hash_collisions_kernel<<<blocks_for(n), kThreads, 0, s>>>(keys_sorted, p->sorted, n, p->iota);
    hash_runs_fix_kernel<<<blocks_for(n), kThreads, 0, s>>>(keys_sorted, p->iota, n, p->sorted, p->perm32);
    return tf_dynemb_segments_cuda(&p->g, stream);
}
