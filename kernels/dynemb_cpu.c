/* Dynamic embedding hash table, CPU path: the semantics of dynemb_cuda.cu, one key or row at a time
 * (see dynemb_kernels.h for the layout and the order of an operation). */
#include "dynemb_kernels.h"

#include <math.h>
#include <string.h>

/* The slot of `key` in its bucket, or -1. */
static int64_t probe(const tf_dynemb_table *t, int64_t key) {
    const uint64_t h = tf_dynemb_hash(key);
    const int64_t base = tf_dynemb_bucket(h, t->num_buckets) * t->bucket_size;
    const uint8_t d = tf_dynemb_digest(h);
    for (int s = 0; s < t->bucket_size; ++s)
        if (t->digests[base + s] == d && t->keys[base + s] == key) return base + s;
    return -1;
}

void tf_dynemb_lookup_cpu(const tf_dynemb_table *t, const tf_dynemb_probe *p, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        const int64_t slot = probe(t, p->query[i]);
        p->slots[i] = slot;
        if (slot >= 0 && p->epoch > 0) t->marks[slot] = p->epoch;
    }
}

void tf_dynemb_insert_cpu(const tf_dynemb_table *t, const tf_dynemb_probe *p) {
    int64_t inserted = 0, evicted = 0, failed = 0;
    for (int64_t i = 0; i < p->n; ++i) {
        p->is_new[i] = 0;
        if (p->slots[i] >= 0) continue;
        const int64_t key = p->query[i];
        const uint64_t h = tf_dynemb_hash(key);
        const int64_t base = tf_dynemb_bucket(h, t->num_buckets) * t->bucket_size;
        const uint8_t d = tf_dynemb_digest(h);
        int64_t slot = -1, empty = -1, victim = -1;
        for (int s = 0; s < t->bucket_size && slot < 0; ++s) {
            const int64_t j = base + s;
            if (t->digests[j] == d && t->keys[j] == key) slot = j;  /* a repeat inserted earlier */
            else if (t->digests[j] == 0) { if (empty < 0) empty = j; }
            else if (t->marks[j] != p->epoch && (victim < 0 || t->scores[j] < t->scores[victim])) victim = j;
        }
        if (slot >= 0) { p->slots[i] = slot; continue; }
        if (empty < 0 && !(p->allow_evict && victim >= 0)) { ++failed; continue; }
        if (empty >= 0) slot = empty;
        else {
            slot = victim;
            p->evicted_keys[evicted] = t->keys[slot];
            p->evicted_slots[evicted] = slot;
            p->evicted_scores[evicted] = t->scores[slot];
            ++evicted;
        }
        t->keys[slot] = key;
        t->digests[slot] = d;
        t->scores[slot] = 0;
        t->marks[slot] = p->epoch;
        p->slots[i] = slot;
        p->is_new[i] = 1;
        ++inserted;
    }
    p->counts[0] = inserted;
    p->counts[1] = evicted;
    p->counts[2] = failed;
}

void tf_dynemb_touch_cpu(int64_t *scores, const int64_t *slots, int64_t n, int policy, int64_t clock) {
    for (int64_t i = 0; i < n; ++i) {
        if (slots[i] < 0) continue;
        if (policy == TF_DYNEMB_LFU) scores[slots[i]] += 1;
        else scores[slots[i]] = clock;
    }
}

void tf_dynemb_gather_cpu(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n, void *out,
                          int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
        const int64_t i = order ? order[j] : j;
        if (i < 0 || i >= n) continue;
        char *dst = (char *)out + i * r->row_bytes;
        if (slots[i] < 0) memset(dst, 0, (size_t)r->row_bytes);
        else memcpy(dst, tf_dynemb_row(r, slots[i]), (size_t)r->row_bytes);
    }
}

void tf_dynemb_scatter_cpu(const tf_dynemb_rows *r, const int64_t *slots, const int64_t *order, int64_t n,
                           const void *src, int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
        const int64_t i = order ? order[j] : j;
        if (i < 0 || i >= n || slots[i] < 0) continue;
        memcpy(tf_dynemb_row(r, slots[i]), (const char *)src + i * r->row_bytes, (size_t)r->row_bytes);
    }
}

void tf_dynemb_init_cpu(const tf_dynemb_init_params *p, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        const int64_t slot = p->slots[i];
        if (slot < 0 || (p->mask && !p->mask[i])) continue;
        if (p->init_kind != TF_INIT_NONE) {
            char *row = tf_dynemb_row(&p->values, slot);
            for (int64_t j = 0; j < p->dim; ++j)
                tf_store_f32(row, p->dtype, j, (float)tf_dynemb_init_value(p->init_kind, p->a, p->b, p->keys[i], p->seed, j));
        }
        if (p->state.row_bytes) memset(tf_dynemb_row(&p->state, slot), 0, (size_t)p->state.row_bytes);
    }
}

void tf_dynemb_init_gather_cpu(const tf_dynemb_init_params *p, const int64_t *order, void *out, int64_t begin,
                               int64_t end) {
    const int64_t vb = p->values.row_bytes;
    for (int64_t j = begin; j < end; ++j) {
        const int64_t i = order ? order[j] : j;
        if (i < 0 || i >= p->n) continue;
        char *dst = (char *)out + i * vb;
        const int64_t slot = p->slots[i];
        if (slot < 0) {
            memset(dst, 0, (size_t)vb);
            continue;
        }
        char *row = tf_dynemb_row(&p->values, slot);
        const int init = p->mask[i] && p->init_kind != TF_INIT_NONE;
        if (init)
            for (int64_t c = 0; c < p->dim; ++c) {
                const float v = (float)tf_dynemb_init_value(p->init_kind, p->a, p->b, p->keys[i], p->seed, c);
                tf_store_f32(row, p->dtype, c, v);
                tf_store_f32(dst, p->dtype, c, v);
            }
        else memcpy(dst, row, (size_t)vb);
        if (p->mask[i] && p->state.row_bytes) memset(tf_dynemb_row(&p->state, slot), 0, (size_t)p->state.row_bytes);
    }
}

void tf_dynemb_evict_rows_cpu(const tf_dynemb_evict_params *p, int64_t begin, int64_t end) {
    const tf_dynemb_init_params *in = &p->init;
    const int64_t vb = in->values.row_bytes, sb = in->state.row_bytes;
    for (int64_t e = begin; e < end; ++e) {
        char *row = tf_dynemb_row(&in->values, p->slots[e]);
        const int64_t i = p->new_index[e];
        memcpy((char *)p->old_values + e * vb, row, (size_t)vb);
        if (sb) {
            char *st = tf_dynemb_row(&in->state, p->slots[e]);
            memcpy((char *)p->old_state + e * sb, st, (size_t)sb);
            memset(st, 0, (size_t)sb);
        }
        if (in->init_kind != TF_INIT_NONE)
            for (int64_t j = 0; j < in->dim; ++j)
                tf_store_f32(row, in->dtype, j, (float)tf_dynemb_init_value(in->init_kind, in->a, in->b, p->keys[i], in->seed, j));
        if (p->rows_out) memcpy((char *)p->rows_out + i * vb, row, (size_t)vb);
    }
}

void tf_dynemb_update_cpu(const tf_dynemb_update_params *p, int64_t begin, int64_t end) {
    const int64_t dim = p->dim;
    for (int64_t i = begin; i < end; ++i) {
        const int64_t slot = p->slots[i];
        if (slot < 0) continue;
        char *row = tf_dynemb_row(&p->values, slot);
        float *st = p->state.row_bytes ? (float *)tf_dynemb_row(&p->state, slot) : NULL;
        const int64_t g0 = i * p->grad_stride;
        float rw_mult = 0.f;
        if (p->opt == TF_OPT_ROWWISE_ADAGRAD) {
            float sq = 0.f;
            for (int64_t j = 0; j < dim; ++j) {
                const float g = tf_load_f32(p->grad, p->grad_dtype, g0 + j);
                sq += g * g;
            }
            st[0] += sq / (float)dim;
            rw_mult = p->lr / (sqrtf(st[0]) + p->eps);
        }
        for (int64_t j = 0; j < dim; ++j) {
            const float g = tf_load_f32(p->grad, p->grad_dtype, g0 + j);
            float w = tf_load_f32(row, p->dtype, j);
            switch (p->opt) {
            case TF_OPT_SGD: w -= p->lr * g; break;
            case TF_OPT_ADAGRAD:
                st[j] += g * g;
                w -= p->lr * g / (sqrtf(st[j]) + p->eps);
                break;
            case TF_OPT_ROWWISE_ADAGRAD: w -= rw_mult * g; break;
            default: { /* Adam, in torch.optim.SparseAdam's form */
                const float m0 = st[j], v0 = st[dim + j];
                const float dm = (g - m0) * (1.f - p->beta1), dv = (g * g - v0) * (1.f - p->beta2);
                const float m = m0 + dm, v = v0 + dv;
                st[j] = m;
                st[dim + j] = v;
                w += -p->step_size * (m / (sqrtf(v) + p->eps));
            }
            }
            tf_store_f32(row, p->dtype, j, w);
        }
    }
}

/* Rows are walked id by id into a block of column sums (each column still sums its ids in order, as
 * the CUDA kernel does): a row is located once per id, not once per element. */
#define TF_POOL_COLS 256
void tf_dynemb_pool_cpu(const tf_dynemb_pool_params *p, int64_t begin, int64_t end) {
    float acc[TF_POOL_COLS];
    for (int64_t b = begin; b < end; ++b) {
        int64_t i0, i1;
        tf_dynemb_pool_bag(p, b, &i0, &i1);
        for (int64_t j0 = 0; j0 < p->dim; j0 += TF_POOL_COLS) {
            const int64_t m = p->dim - j0 < TF_POOL_COLS ? p->dim - j0 : TF_POOL_COLS;
            for (int64_t j = 0; j < m; ++j) acc[j] = 0.f;
            for (int64_t i = i0; i < i1; ++i) {
                const int64_t slot = tf_dynemb_pool_slot(p, i);
                if (slot < 0) continue;
                const char *row = tf_dynemb_row(&p->values, slot);
                if (p->dtype == TF_F32) {
                    const float *r = (const float *)row + j0;
                    if (p->weights) {
                        const float w = p->weights[i];
                        for (int64_t j = 0; j < m; ++j) acc[j] += w * r[j];
                    } else {
                        for (int64_t j = 0; j < m; ++j) acc[j] += r[j];
                    }
                } else {
                    for (int64_t j = 0; j < m; ++j) {
                        const float v = tf_load_f32(row, p->dtype, j0 + j);
                        acc[j] += p->weights ? p->weights[i] * v : v;
                    }
                }
            }
            const int64_t o = tf_dynemb_pool_out_index(p, b) + j0;
            for (int64_t j = 0; j < m; ++j) {
                float v = acc[j];
                if (p->mean && i1 > i0) v /= (float)(i1 - i0);
                tf_store_f32(p->out, p->out_dtype, o + j, v);
            }
        }
    }
}

void tf_dynemb_segsum_cpu(const tf_dynemb_segsum_params *p, int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
        float *o = p->out + u * p->dim;
        for (int64_t j = 0; j < p->dim; ++j) o[j] = 0.f;
        for (int64_t k = p->seg[u]; k < p->seg[u + 1]; ++k) {
            const int64_t i = p->perm[k];
            const int64_t src = p->bag_of ? p->bag_of[i] : i;
            const float s = p->scale ? p->scale[i] : 1.f;
            for (int64_t j = 0; j < p->dim; ++j) o[j] += s * tf_load_f32(p->grad, p->grad_dtype, src * p->dim + j);
        }
    }
}
