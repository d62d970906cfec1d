// Dynamic embedding, CUDA: insert (locked, a warp per key), touch, find-or-insert (two steps, lock-free)
// and the eviction row work after it.

#include "dynemb_common.cuh"

namespace {

struct TouchArgs {
    int64_t *scores;
    const int64_t *slots;
    int policy;
    int64_t clock;
};

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
__global__ void insert_kernel(const __grid_constant__ Tables<ProbeArgs, N> g) {
    warp_item(g, [](const ProbeArgs &a, int64_t i, int lane) { insert_one(a.t, a.p, i, lane); });
}

template <int N>
__global__ void touch_kernel(const __grid_constant__ Tables<TouchArgs, N> g) {
    int t;
    int64_t i;
    if (!tables_item(g, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, t, i)) return;
    const TouchArgs &a = g.p[t];
    const int64_t slot = a.slots[i];
    if (slot < 0) return;
    if (a.policy == TF_DYNEMB_LFU) atomicAdd(reinterpret_cast<unsigned long long *>(&a.scores[slot]), 1ull);
    else a.scores[slot] = a.clock;
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
    // Lane ql holds slots 8k + ql, so each load of the quarter is 64 contiguous bytes (two whole
    // sectors); 16 consecutive slots a lane made every 8-byte load its own sector, 4x the L2 traffic.
    int64_t sc[16];
    unsigned eligible = 0xffffu;  // bit k: slot base + 8k + ql not yet lost to another quarter
#pragma unroll
    for (int k = 0; k < 16; ++k) sc[k] = __ldcg(&t.scores[base + 8 * k + ql]);
    for (;;) {
        int64_t vs = 0, vj = -1;
#pragma unroll
        for (int k = 0; k < 16; ++k)
            if ((eligible >> k) & 1u) min_victim(vs, vj, sc[k], base + 8 * k + ql);
        for (int o = 4; o > 0; o >>= 1) {
            const int64_t s2 = __shfl_xor_sync(qmask, vs, o), j2 = __shfl_xor_sync(qmask, vj, o);
            min_victim(vs, vj, s2, j2);
        }
        if (vj < 0) return Claim{-1, 0, 0, false};  // full of this call's keys
        const int owner = static_cast<int>((vj - base) & 7);
        bool won = false;
        int64_t vkey = 0;
        if (ql == owner) {
            won = atomicExch(&t.marks[vj], p.epoch) != p.epoch;
            if (won) vkey = __ldcg(&t.keys[vj]);
            else eligible &= ~(1u << ((vj - base) >> 3));
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

}  // namespace

extern "C" {

int tf_dynemb_tables_insert_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, const int64_t *start,
                                 int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return probe_chunks(t, p, start, n_tables, [&](const ProbeArgs *a, const int64_t *st, int k) {
        return TF_TABLES_LAUNCH(ProbeArgs, a, st, k, insert_kernel, grid_for_warps, s);
    });
}

int tf_dynemb_insert_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, void *stream) {
    const int64_t start[2] = {0, p->n};
    return tf_dynemb_tables_insert_cuda(t, p, start, 1, stream);
}

int tf_dynemb_tables_touch_cuda(int64_t *const *scores, const int64_t *slots, const int64_t *start, const int *policy,
                                const int64_t *clock, int n_tables, void *stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    for (int c = 0; c < n_tables; c += TF_DYNEMB_TABLES_MAX) {
        TouchArgs a[TF_DYNEMB_TABLES_MAX];
        const int k = n_tables - c < TF_DYNEMB_TABLES_MAX ? n_tables - c : TF_DYNEMB_TABLES_MAX;
        for (int j = 0; j < k; ++j) a[j] = TouchArgs{scores[c + j], slots + start[c + j], policy[c + j], clock[c + j]};
        const int err = TF_TABLES_LAUNCH(TouchArgs, a, start + c, k, touch_kernel, grid_for_threads, s);
        if (err) return err;
    }
    return 0;
}

int tf_dynemb_touch_cuda(int64_t *scores, const int64_t *slots, int64_t n, int policy, int64_t clock, void *stream) {
    const int64_t start[2] = {0, n};
    return tf_dynemb_tables_touch_cuda(&scores, slots, start, &policy, &clock, 1, stream);
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
