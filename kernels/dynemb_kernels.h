/* Dynamic embedding hash table: the C ABI of the kernel family (CPU: dynemb_cpu.c, CUDA: dynemb_cuda.cu).
 *
 * Layout (HierarchicalKV-style): the table has num_buckets (a power of two) buckets of bucket_size
 * slots (a power of two, 4..128). Per slot, in separate arrays indexed by slot:
 *   digests  uint8:  0 = empty, else a 1..255 digest of the key's hash (every int64 is a usable key:
 *                    emptiness is the digest, never a reserved key value)
 *   keys     int64:  the key (meaningless when the digest is 0)
 *   scores   int64:  LRU: the table clock at the last access; LFU: the access count
 *   marks    int32:  the epoch of the last operation that touched the slot; eviction never takes a
 *                    slot marked with the current epoch, so keys found or inserted by the running
 *                    batch stay where the batch saw them
 * and per bucket an int32 lock (CUDA inserts only). A key lives in exactly one bucket,
 * tf_dynemb_bucket(hash): a probe reads that bucket's digests (one 128-byte line at 128 slots) and
 * compares keys only where the digest matches.
 *
 * Rows (values, and the optimizer state beside them) are addressed by slot through a two-tier
 * tf_dynemb_rows: slots below n_hbm in `hbm`, the rest in `host` (pinned, mapped host memory that
 * CUDA kernels read over PCIe; NULL when every row is in hbm).
 *
 * An operation on a batch is: lookup (read-only probe, marks found slots), insert of the keys still
 * missing (per-bucket lock on CUDA, re-probe under the lock so repeated keys end in one slot; an
 * empty slot, else with allow_evict the unmarked slot of least (score, slot)), then row work by
 * slot (init of new rows, gather, scatter, optimizer update). Victims are order-independent: a
 * bucket receiving k new keys loses its k least (score, slot) unmarked keys whatever the order. */
#ifndef TF_DYNEMB_KERNELS_H
#define TF_DYNEMB_KERNELS_H

#include <math.h>
#include <stdint.h>

#include "tf_dtype.h"

#ifdef __CUDACC__
#define TF_HD __host__ __device__ __forceinline__
#else
#define TF_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum { TF_DYNEMB_LRU = 0, TF_DYNEMB_LFU = 1 };
enum { TF_INIT_NONE = 0, TF_INIT_NORMAL = 1, TF_INIT_UNIFORM = 2, TF_INIT_CONSTANT = 3 };
enum { TF_OPT_SGD = 0, TF_OPT_ADAGRAD = 1, TF_OPT_ROWWISE_ADAGRAD = 2, TF_OPT_ADAM = 3 };

/* splitmix64's finalizer: a bijection on 64 bits, so distinct keys never share a full hash. */
TF_HD uint64_t tf_mix64(uint64_t x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}
TF_HD uint64_t tf_dynemb_hash(int64_t key) { return tf_mix64((uint64_t)key); }
/* Bucket from the low bits, digest from the top byte (independent of the bucket bits). */
TF_HD int64_t tf_dynemb_bucket(uint64_t h, int64_t num_buckets) { return (int64_t)(h & (uint64_t)(num_buckets - 1)); }
TF_HD uint8_t tf_dynemb_digest(uint64_t h) { uint8_t d = (uint8_t)(h >> 56); return d ? d : (uint8_t)1; }

/* The vacant-key rule: an empty slot (digest 0) holds a key that hashes to another bucket (the
 * Python side writes it at allocation and erase). A probe therefore never matches an empty slot's
 * key, even when it reads the digest of a key being placed there concurrently before that key
 * itself: what CUDA find_or_insert relies on to insert while other keys of the batch probe (with one
 * bucket no such key exists, and it inserts in a second kernel instead). */
typedef struct {
    int64_t *keys;
    uint8_t *digests;
    int64_t *scores;
    int32_t *marks;
    int32_t *locks;       /* num_buckets, zero when idle; CUDA only (may be NULL on CPU) */
    int64_t num_buckets;
    int bucket_size;
} tf_dynemb_table;

typedef struct {
    char *hbm;            /* rows [0, n_hbm) */
    char *host;           /* rows [n_hbm, ...), NULL when none */
    int64_t n_hbm;
    int64_t row_bytes;
} tf_dynemb_rows;

TF_HD char *tf_dynemb_row(const tf_dynemb_rows *r, int64_t slot) {
    return slot < r->n_hbm ? r->hbm + slot * r->row_bytes : r->host + (slot - r->n_hbm) * r->row_bytes;
}

/* A table's whole state: the hash table, its rows (values, `dtype`, dim per row) and their fp32
 * optimizer state (state_dim per row; 0 for SGD), both split alike between hbm and host. The glue
 * (csrc/dynemb.h, dynemb_state) builds it from the one list of tensors the ops take per table and
 * every kernel parameter block below is filled from it. */
typedef struct {
    tf_dynemb_table t;
    tf_dynemb_rows values; int dtype; int64_t dim;
    tf_dynemb_rows state; int64_t state_dim;
} tf_dynemb_state;

typedef struct {
    int64_t n;                 /* number of queried keys */
    const int64_t *query;      /* n keys */
    int64_t *slots;            /* n: lookup writes slot or -1; insert fills the -1 entries it places */
    int32_t epoch;             /* > 0: mark found / inserted slots with it; 0: lookup leaves marks alone */
    /* insert only */
    int allow_evict;
    uint8_t *is_new;           /* n: 1 where this key was inserted by this call (one of repeated keys) */
    int64_t *evicted_keys;     /* capacity n each: what eviction removed, in no particular order */
    int64_t *evicted_slots;
    int64_t *evicted_scores;
    int64_t *counts;           /* 3: inserted, evicted, failed (no slot: bucket full, no eviction allowed) */
} tf_dynemb_probe;

typedef struct {
    int64_t n;
    const int64_t *slots;      /* n; entries < 0 are skipped */
    const int64_t *keys;       /* n: the keys, for init's per-key random numbers */
    const uint8_t *mask;       /* n or NULL: only rows with mask[i] != 0 */
    tf_dynemb_rows values; int dtype; int64_t dim;
    tf_dynemb_rows state;      /* fp32 optimizer state, sdim per row (row_bytes 0: none) */
    int init_kind;             /* TF_INIT_*: values; the state is zeroed */
    double a, b;               /* normal (mean, std), uniform (lo, hi), constant (a) */
    uint64_t seed;
} tf_dynemb_init_params;

/* find-or-insert of distinct keys (required: the CUDA insert claims slots without a bucket lock, by
 * swapping the slot's mark to the epoch, and would place a repeated key twice) with the row work folded in (the table ops' semantics, in order:
 * lookup marking found slots; insert of the missing keys; init of the new rows; touch of every key;
 * the rows copied out). Except, when keep_victims: a key that took an evicted key's slot gets neither
 * its row initialized nor copied out: evicted_new[e] names it (e < counts[1]); the caller saves the
 * victim's row, then initializes and copies it. keep_victims = 0 (a caller that records no evicted
 * rows): such keys get their rows like any new key, and the victims' rows are overwritten. Used: the
 * probe's query, slots, epoch, allow_evict, is_new, evicted arrays and counts; the init's values/state/dtype/dim/initializer are used (init.slots = p.slots, init.keys =
 * p.query, init.mask unused). policy: TF_DYNEMB_LRU / LFU, or -1 for no touch. */
typedef struct {
    tf_dynemb_probe p;
    tf_dynemb_init_params init;
    int policy; int64_t clock;
    void *out;                 /* n rows of values.row_bytes, or NULL */
    int64_t *evicted_new;      /* capacity n; NULL with the probe's evicted arrays on CUDA with 128-slot
                                  buckets when keep_victims is 0 (no eviction list is written) */
    int keep_victims;          /* 1: evicting keys' rows are left to the caller (above); 0: written here */
    uint8_t *miss;             /* CUDA with 128-slot buckets: scratch of tf_dynemb_foi_miss_bytes(n) */
    int fill_outputs;          /* CUDA with 128-slot buckets: step 1 sets is_new to 0, the evicted arrays and
                                  evicted_new to -1 and counts to 0 (the caller left them unwritten) */
    /* CUDA, both may be NULL. n_valid: device memory holding how many of the n keys to take (the
     * first ones; at most n): a batch grouped on the device, whose number of distinct keys the host
     * has not read, is inserted without a host sync between. abort: a device flag; when set, the
     * kernels take no key (a check of the caller's arguments that the host has not read yet): the
     * table is untouched and the counts are zero. Slots past the keys taken are -1 (the pool op
     * queued before the host's wait reads every one); the other outputs there are unwritten. */
    const int64_t *n_valid;
    const uint8_t *abort;
    /* CUDA with 128-slot buckets, may be NULL: mapped pinned host memory of 6 int64. Step 2's last
     * block writes the counts, the keys taken (*n_valid, or n) and the abort flag into [0..4], then,
     * after a system-wide fence, host_seq into [5]: the host waits for that word instead of copying
     * the counts and synchronizing the stream (each a round trip through the driver). */
    int64_t *host_counts;
    int64_t host_seq;
} tf_dynemb_foi_params;

/* Step 1 lists the keys it left to step 2: a count, step 1's insert count and step 2's count of
 * finished blocks (8 bytes each; the caller zeroes these tf_dynemb_foi_miss_zeroed bytes), a pad word,
 * then n keys (int64), n indices (int32: n < 2^31) and n slot choices (bytes). */
TF_HD int64_t tf_dynemb_foi_miss_bytes(int64_t n) { return 32 + 13 * n; }
#define tf_dynemb_foi_miss_zeroed 24

/* The row work of find_or_insert's evictions, after the call's counts are known: per eviction e,
 * old_values[e] / old_state[e] = the victim's row and optimizer state (slot slots[e]), then the slot
 * gets the row of key keys[new_index[e]] from the initializer and zeroed state, and, when rows_out is
 * not NULL, row new_index[e] of rows_out gets that new row. init: values, state, dtype, dim and the
 * initializer (its n, slots, keys and mask are unused). */
typedef struct {
    int64_t n;
    const int64_t *slots, *new_index, *keys;
    tf_dynemb_init_params init;
    void *rows_out;
    void *old_values;
    float *old_state;
} tf_dynemb_evict_params;

/* Per row i (unique slots): optimizer step on values[slots[i]] with gradient row grad[i]. */
typedef struct {
    int64_t n;
    const int64_t *slots;      /* n unique slots; entries < 0 are skipped */
    const void *grad; int grad_dtype; int64_t grad_stride;
    tf_dynemb_rows values; int dtype; int64_t dim;
    tf_dynemb_rows state;      /* Adagrad: dim sums; RowWiseAdagrad: 1; Adam: dim exp_avg, dim exp_avg_sq */
    int opt;
    float lr, eps, beta1, beta2;
    float step_size;           /* Adam: lr * sqrt(1 - beta2^t) / (1 - beta1^t) */
} tf_dynemb_update_params;

/* Bag pooling straight from the table: out[b] = sum over i in [offsets[b], offsets[b+1]) of
 * w_i * row(slots[i]) (w_i = weights[i], or 1), divided by the bag's length when mean; fp32
 * accumulation in id order, rounded once to the row dtype; rows of slot -1 count as zeros. */
typedef struct {
    int64_t n_bags;
    const int64_t *slots, *offsets;  /* offsets: n_bags + 1 */
    int64_t n_ids;                   /* ids in the batch: bag bounds are clamped into [0, n_ids] */
    const int64_t *inv;              /* NULL: id i's slot is slots[i]; else slots[inv[i]] (-1 unless 0 <= inv[i] < n_slots) */
    int64_t n_slots;
    const float *weights;            /* NULL: ones */
    int mean;
    tf_dynemb_rows values; int dtype; int64_t dim;
    /* Bag b's row goes to out[(b % out_block_bags) * out_row_stride + (b / out_block_bags) * dim],
     * in out_dtype: (n_bags, dim) contiguous is out_block_bags = n_bags, out_row_stride = dim; a
     * collection's features (f, b) land in the (B, features x dim) layout of a TorchRec KeyedTensor
     * with out_block_bags = B. */
    void *out; int out_dtype;
    int64_t out_block_bags, out_row_stride;
} tf_dynemb_pool_params;

/* Bag b's ids [*i0, *i1): its offsets clamped into [0, n_ids] (offsets out of order give short or
 * empty bags, never a read outside the batch). */
TF_HD void tf_dynemb_pool_bag(const tf_dynemb_pool_params *p, int64_t b, int64_t *i0, int64_t *i1) {
    int64_t a = p->offsets[b], e = p->offsets[b + 1];
    a = a < 0 ? 0 : (a > p->n_ids ? p->n_ids : a);
    e = e < a ? a : (e > p->n_ids ? p->n_ids : e);
    *i0 = a;
    *i1 = e;
}
/* Id i's slot: slots[i], or through inv (a batch pooled from its unique ids' slots). */
TF_HD int64_t tf_dynemb_pool_slot(const tf_dynemb_pool_params *p, int64_t i) {
    if (!p->inv) return p->slots[i];
    const int64_t u = p->inv[i];
    return u >= 0 && u < p->n_slots ? p->slots[u] : -1;
}

TF_HD int64_t tf_dynemb_pool_out_index(const tf_dynemb_pool_params *p, int64_t b) {
    return (b % p->out_block_bags) * p->out_row_stride + (b / p->out_block_bags) * p->dim;
}

/* Deterministic gradient per unique id: out[u] = sum over j in [seg[u], seg[u+1]) of
 * scale[perm[j]] * grad[src(perm[j])] (src(i) = bag_of[i], or i when bag_of is NULL), fp32. perm
 * lists the ids grouped by unique id (a stable sort). The CPU sums in j order; CUDA cuts the
 * occurrence list into fixed chunks of TF_DYNEMB_SEG_CHUNK (a hot id of a skewed batch is spread over
 * many warps instead of one) and adds an id's chunk sums as a fixed tree: chunks one by one up to a
 * multiple of TF_DYNEMB_SEG_FAN, then sums of TF_DYNEMB_SEG_FAN chunks, then of TF_DYNEMB_SEG_FAN^2,
 * each taken where it lies wholly inside the id's run. The order depends only on where the run lies,
 * so the result is the same run to run. */
#define TF_DYNEMB_SEG_CHUNK 32
#define TF_DYNEMB_SEG_FAN 32
TF_HD int64_t tf_dynemb_seg_chunks(int64_t n_occ) { return (n_occ + TF_DYNEMB_SEG_CHUNK - 1) / TF_DYNEMB_SEG_CHUNK; }
/* Rows of tf_dynemb_segsum_params.partial: two per chunk, then one per whole group of FAN chunks,
 * then one per whole group of FAN^2 chunks. */
TF_HD int64_t tf_dynemb_seg_partial_rows(int64_t n_occ) {
    const int64_t c = tf_dynemb_seg_chunks(n_occ);
    return 2 * c + c / TF_DYNEMB_SEG_FAN + c / (TF_DYNEMB_SEG_FAN * TF_DYNEMB_SEG_FAN);
}
typedef struct {
    int64_t n_unique, dim;
    int64_t n_occ;                        /* entries of perm (= seg[n_unique]) */
    const int64_t *perm, *seg, *bag_of;   /* bag_of may be NULL */
    const float *scale;                   /* NULL: ones */
    const void *grad; int grad_dtype;     /* rows of dim, contiguous */
    float *out;                           /* n_unique x dim */
    float *partial;                       /* CUDA only: tf_dynemb_seg_partial_rows(n_occ) x dim scratch */
} tf_dynemb_segsum_params;

/* The i-th per-key random number in [0, 1) of init for `key`; identical on CPU and CUDA. */
TF_HD double tf_dynemb_uniform(int64_t key, uint64_t seed, uint64_t i) {
    uint64_t h = tf_mix64(tf_mix64((uint64_t)key ^ tf_mix64(seed + 0x9e3779b97f4a7c15ULL)) + i);
    return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/* Value j of a new row for `key` (before rounding to the row dtype). */
TF_HD double tf_dynemb_init_value(int kind, double a, double b, int64_t key, uint64_t seed, int64_t j) {
    if (kind == TF_INIT_CONSTANT) return a;
    if (kind == TF_INIT_UNIFORM) return a + (b - a) * tf_dynemb_uniform(key, seed, (uint64_t)j);
    /* normal: Box-Muller on two per-key uniforms in (0, 1) */
    const double u1 = tf_dynemb_uniform(key, seed, 2 * (uint64_t)j), u2 = tf_dynemb_uniform(key, seed, 2 * (uint64_t)j + 1);
    return a + b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* ---- CPU (kernels/dynemb_cpu.c); ranges [begin, end) of the batch ---- */
void tf_dynemb_lookup_cpu(const tf_dynemb_table *t, const tf_dynemb_probe *p, int64_t begin, int64_t end);
/* Sequential over the whole batch (insertion order decides nothing observable but slot positions). */
void tf_dynemb_insert_cpu(const tf_dynemb_table *t, const tf_dynemb_probe *p);
/* LRU: scores[slot] = clock; LFU: scores[slot] += 1 per occurrence. Sequential. */
void tf_dynemb_touch_cpu(int64_t *scores, const int64_t *slots, int64_t n, int policy, int64_t clock);
/* out[i] = row slots[i] (zeros where slots[i] < 0); rows are row_bytes wide. order (NULL: identity;
 * else n entries): step j of the range handles i = order[j] (skipped unless 0 <= order[j] < n), so a
 * permutation such as argsort(slots) visits the rows in slot order (host rows in address order). */
void tf_dynemb_gather_cpu(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n, void *out,
                          int64_t begin, int64_t end);
/* row slots[i] = src[i] (skipped where slots[i] < 0); order as for gather. */
void tf_dynemb_scatter_cpu(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n,
                           const void *src, int64_t begin, int64_t end);
void tf_dynemb_init_cpu(const tf_dynemb_init_params *p, int64_t begin, int64_t end);
/* init and gather in one pass (dynemb_init_gather): step j of the range handles i = order[j] (order
 * NULL: i = j; skipped unless 0 <= i < n). slots[i] < 0: out[i] = zeros. Else where mask[i] != 0 (mask
 * required: the keys' is_new) the row is initialised as tf_dynemb_init_cpu does (values from the
 * initializer unless TF_INIT_NONE, state zeroed) and written to out[i] as well; elsewhere out[i] = the
 * table's row. out: n rows of values.row_bytes. The same results as init, then gather. */
void tf_dynemb_init_gather_cpu(const tf_dynemb_init_params *p, const int64_t *order, void *out, int64_t begin,
                               int64_t end);
void tf_dynemb_evict_rows_cpu(const tf_dynemb_evict_params *p, int64_t begin, int64_t end);
void tf_dynemb_update_cpu(const tf_dynemb_update_params *p, int64_t begin, int64_t end);
void tf_dynemb_pool_cpu(const tf_dynemb_pool_params *p, int64_t begin, int64_t end);
void tf_dynemb_segsum_cpu(const tf_dynemb_segsum_params *p, int64_t begin, int64_t end);

/* ---- CUDA (kernels/dynemb_cuda.cu); return a cudaError_t as int ---- */
int tf_dynemb_lookup_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, void *stream);
/* lookup + gather in one kernel: slots[i] and row i of out (zeros where absent). */
int tf_dynemb_find_cuda(const tf_dynemb_table *t, const int64_t *query, int64_t n, int64_t *slots,
                        const tf_dynemb_rows *r, void *out, void *stream);
int tf_dynemb_insert_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, void *stream);
int tf_dynemb_touch_cuda(int64_t *scores, const int64_t *slots, int64_t n, int policy, int64_t clock, void *stream);
/* Gather / scatter as on the CPU; order (NULL: identity; else n entries): thread row j handles batch
 * index order[j] (skipped unless in [0, n)). With order = argsort(slots) the rows are read / written
 * in slot order: host rows in address order, which the GPU's translation of host pages needs (random
 * host addresses run several times slower). The result does not depend on order when it is a
 * permutation. */
int tf_dynemb_gather_cuda(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n, void *out,
                          void *stream);
int tf_dynemb_scatter_cuda(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n,
                           const void *src, void *stream);
int tf_dynemb_init_cuda(const tf_dynemb_init_params *p, void *stream);
/* init + gather in one pass, as tf_dynemb_init_gather_cpu; with order = argsort(slots) the rows are
 * initialised, read and written in slot order (host rows in address order). A new row's values go
 * to the table and to out from registers: nothing is read back. */
int tf_dynemb_init_gather_cuda(const tf_dynemb_init_params *p, const int64_t *order, void *out, void *stream);
int tf_dynemb_evict_rows_cuda(const tf_dynemb_evict_params *p, void *stream);
int tf_dynemb_update_cuda(const tf_dynemb_update_params *p, void *stream);
int tf_dynemb_pool_cuda(const tf_dynemb_pool_params *p, void *stream);
int tf_dynemb_segsum_cuda(const tf_dynemb_segsum_params *p, void *stream);
/* The segment sum applied as an optimizer step straight away (u: slots = the unique ids' slots; its
 * grad unused): the same result as segsum then update, without writing the sums out. Rows of at most
 * TF_DYNEMB_SEGSUM_UPDATE_MAX_DIM columns (else cudaErrorInvalidValue). p->partial is needed, p->out not. */
#define TF_DYNEMB_SEGSUM_UPDATE_MAX_DIM 128
int tf_dynemb_segsum_update_cuda(const tf_dynemb_segsum_params *p, const tf_dynemb_update_params *u, void *stream);
int tf_dynemb_find_or_insert_cuda(const tf_dynemb_table *t, const tf_dynemb_foi_params *p, void *stream);

/* Table-batched forms: one launch over the concatenated items of n_tables tables (keys for
 * lookup / insert / init / touch / update, bags for pool). Table t's items are [start[t],
 * start[t + 1]) of the batch; its params (t[i], p[i]) point at its own part (their n is ignored:
 * the starts count). Touch: scores[t] is table t's scores, slots the concatenated batch. */
#define TF_DYNEMB_TABLES_MAX 32
int tf_dynemb_tables_lookup_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, const int64_t *start,
                                 int n_tables, void *stream);
int tf_dynemb_tables_insert_cuda(const tf_dynemb_table *t, const tf_dynemb_probe *p, const int64_t *start,
                                 int n_tables, void *stream);
int tf_dynemb_tables_init_cuda(const tf_dynemb_init_params *p, const int64_t *start, int n_tables, void *stream);
int tf_dynemb_tables_touch_cuda(int64_t *const *scores, const int64_t *slots, const int64_t *start, const int *policy,
                                const int64_t *clock, int n_tables, void *stream);
int tf_dynemb_tables_update_cuda(const tf_dynemb_update_params *p, const int64_t *start, int n_tables, void *stream);
int tf_dynemb_tables_pool_cuda(const tf_dynemb_pool_params *p, const int64_t *start, int n_tables, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TF_DYNEMB_KERNELS_H */
