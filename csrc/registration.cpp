// Every torchfuse op schema, in one place, a section per op family. Implementations register per
// device next to their code (e.g. norm.cpp: CPU, norm_cuda.cpp: CUDA); fake (meta) kernels and autograd
// are registered in Python (python/torchfuse/<family>.py), but for the norms' autograd, which is in C++
// (norm_autograd.cpp).
#include <torch/library.h>

TORCH_LIBRARY(torchfuse, m) {
    // Fused residual add + LayerNorm / RMSNorm (python/torchfuse/norm.py documents the semantics).
    // norm_type: 0 LayerNorm, 1 RMSNorm with HF Llama's casts, 2 RMSNorm with Gemma's.
    // Returns (y, y2, s, mean, rstd); y2, s, mean and rstd are empty when not asked for.
    m.def(
        "norm_fwd(Tensor x, Tensor? residual, Tensor? residual2, Tensor? weight, Tensor? bias, "
        "Tensor? weight2, Tensor? bias2, float eps, int norm_type, float weight_offset, "
        "ScalarType? residual_dtype, bool save_stats) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
    // Inference-only norm_fwd for the common case (no residual2, no second norm, s in residual's
    // dtype): fewer arguments and outputs, so a decode-sized call costs little more than its launch.
    // Returns (y, s), s empty without a residual. Refuses inputs that require grad.
    m.def(
        "add_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, int norm_type, "
        "float weight_offset) -> (Tensor, Tensor)");
    // LayerNorm of a 2-D x as the first columns of (rows, round_up(cols + 1, 8)) rows [LN(x), 1, 0...]:
    // a GEMM input whose weight gradient GEMM also yields the bias gradient (hstu_preprocess).
    // Returns (y, mean, rstd); mean and rstd empty unless save_stats. Not differentiable (refused where
    // autograd would record it).
    m.def(
        "layer_norm_with_ones(Tensor x, Tensor? weight, Tensor? bias, float eps, bool save_stats) "
        "-> (Tensor, Tensor, Tensor)");
    // Gradients of norm_fwd: (dx, dresidual, dresidual2, dweight, dbias, dweight2, dbias2). dresidual
    // (dresidual2) is empty unless residual_dtype (residual2_dtype) asks for a separate copy; weight
    // gradients are empty unless weight_grad and the parameter exists.
    m.def(
        "norm_bwd(Tensor? dy, Tensor? dy2, Tensor? ds, Tensor s, Tensor mean, Tensor rstd, Tensor? weight, "
        "Tensor? weight2, int norm_type, float weight_offset, bool has_bias, bool has_bias2, "
        "ScalarType x_dtype, ScalarType? residual_dtype, ScalarType? residual2_dtype, bool weight_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");

    // ---- jagged tensor ops (python/torchfuse/jagged.py) ----
    // Offsets are int32 or int64 (B+1 entries); sizes passed in (SymInt) spare the op a device sync.
    m.def("complete_cumsum(Tensor lengths) -> Tensor");
    m.def("jagged_to_padded_dense(Tensor values, Tensor offsets, SymInt max_length, float padding_value=0.0) -> Tensor");
    m.def("dense_to_jagged(Tensor dense, Tensor offsets, SymInt? total_length=None) -> Tensor");
    m.def("jagged_dense_add(Tensor values, Tensor offsets, Tensor dense) -> Tensor");
    m.def("jagged_dense_mul(Tensor values, Tensor offsets, Tensor dense) -> Tensor");
    // Returns (values, offsets); offsets = offsets_left + offsets_right (a dense side counts max_len each).
    m.def(
        "concat_2d_jagged(Tensor values_left, Tensor? offsets_left, Tensor values_right, Tensor? offsets_right, "
        "SymInt? max_len_left=None, SymInt? max_len_right=None, int n_prefix_from_right=0) -> (Tensor, Tensor)");
    m.def(
        "split_2d_jagged(Tensor values, Tensor? offsets_left, Tensor? offsets_right, SymInt? max_len_left=None, "
        "SymInt? max_len_right=None, int n_prefix_to_right=0, SymInt? total_len_left=None, "
        "SymInt? total_len_right=None) -> (Tensor, Tensor)");
    m.def("jagged_concat(Tensor[] values_list, Tensor[] offsets_list) -> (Tensor, Tensor)");
    // The inverse of jagged_concat: totals[i] rows for part i.
    m.def("jagged_split(Tensor values, Tensor[] offsets_list, SymInt[] totals) -> Tensor[]");
    // Returns (values, lengths) of the selected samples.
    m.def(
        "jagged_index_select(Tensor values, Tensor lengths, Tensor indices, SymInt? total_length=None) "
        "-> (Tensor, Tensor)");

    // ---- HSTU attention (python/torchfuse/hstu.py) ----
    // out = (M . SiLU(alpha (q k^T + attn_bias))) / S @ v per jagged sequence; delta > 0: q holds the
    // last delta query rows of every sequence (cached inference). kernels/hstu_kernels.h has the semantics.
    // validate: check offsets / lengths / targets on the host (a device-to-host copy, so a sync on a GPU);
    // without it the caller guarantees them and outputs start zeroed. backend: the CUDA kernels, "auto",
    // "sm90" or "mma" (None: TORCHFUSE_HSTU_BACKEND, else auto; csrc/hstu.h).
    m.def(
        "hstu_fwd(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, Tensor? attn_bias, "
        "int max_seq_len, float alpha, int? scaling_seqlen, int contextual_seq_len, int max_attn_len, "
        "int min_full_attn_seq_len, int target_group_size, int delta, bool validate=True, str? backend=None, "
        "float dropout_p=0.0, Tensor? rng_state=None, Tensor? kv_lengths=None) -> Tensor");
    // kv_lengths (delta > 0 only): sequence b's keys are the first kv_lengths[b] rows of its seq_offsets span.
    // dropout_p > 0 (delta = 0 only): dropout on the attention weights, its mask from rng_state
    // (hstu_dropout_state), the same in hstu_bwd.
    // Gradients of hstu_fwd (delta = 0): (dq, dk, dv, dattn_bias); dattn_bias empty unless bias_grad.
    m.def(
        "hstu_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, "
        "Tensor? attn_bias, int max_seq_len, float alpha, int? scaling_seqlen, int contextual_seq_len, "
        "int max_attn_len, int min_full_attn_seq_len, int target_group_size, bool bias_grad, str? backend=None, "
        "float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor, Tensor, Tensor, Tensor)");
    // hstu_bwd without the bias gradient, dq, dk, dv written into the caller's tensors: q's, k's, v's shapes,
    // each row's heads contiguous, any row stride (e.g. disjoint column views of one buffer laid out as a
    // fused projection's output, which its backward then reads as one gradient, no concatenation).
    m.def(
        "hstu_bwd_into(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, "
        "Tensor? attn_bias, int max_seq_len, float alpha, int? scaling_seqlen, int contextual_seq_len, "
        "int max_attn_len, int min_full_attn_seq_len, int target_group_size, Tensor(a!) dq, Tensor(b!) dk, "
        "Tensor(c!) dv, str? backend=None, float dropout_p=0.0, Tensor? rng_state=None) -> ()");
    // Dropout's Philox (seed, offset) for one hstu_fwd call and its backward: int64 (2,) on like's device.
    // seed=None draws from torch's default generator of that device (on CUDA the 4 offsets PyTorch's fused
    // dropout reserves, the values written on the device, so a captured CUDA graph draws anew each replay).
    // Seeded from the generator: tagged so that compilers neither merge nor reorder two calls.
    m.def("hstu_dropout_state(Tensor like, int? seed=None) -> Tensor", {at::Tag::nondeterministic_seeded});

    // ---- dynamic embeddings (python/torchfuse/dynamic_embedding/) ----
    // Internal ops on a table's state (layout and semantics: kernels/dynemb_kernels.h). `table` is the
    // table's state as one list, in this order (csrc/dynemb.h DynembField, _table.py STATE_FIELDS):
    // [keys, digests, scores, marks, locks, values, values_host, state, state_host]; the bucket size
    // is capacity / len(locks). Ops that may write any of it take it as Tensor(a!)[]. Slots passed
    // back in must come from dynemb_lookup / dynemb_insert on the same table.
    // Slot of each query key (-1: absent); epoch > 0 also marks the found slots.
    m.def("dynemb_lookup(Tensor query, Tensor(a!)[] table, int epoch) -> Tensor");
    // dynemb_lookup + dynemb_gather of the values in one pass: (rows of the query keys, zeros where absent; slots).
    m.def("dynemb_find(Tensor query, Tensor[] table) -> (Tensor, Tensor)");
    // Places the keys whose slot is -1 (repeats end in one slot); returns (is_new uint8, evicted_keys,
    // evicted_slots, evicted_scores, counts = [inserted, evicted, failed]); evicted_* hold counts[1] entries.
    m.def("dynemb_insert(Tensor query, Tensor(a!) slots, Tensor(b!)[] table, int epoch, bool allow_evict) "
          "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
    // policy 0 (LRU): scores[slot] = clock; 1 (LFU): scores[slot] += 1 per occurrence.
    m.def("dynemb_touch(Tensor(a!)[] table, Tensor slots, int policy, int clock) -> ()");
    // Rows by slot from two-tier storage (rows: the first rows.size(0) slots, rows_host: the rest); zeros for -1.
    // Scatter writes row slots[i] = src[i] (skipped for -1). order: a permutation of 0..n-1 (e.g.
    // argsort(slots)): the rows are visited in that order (host rows in address order); the result is
    // the same as without it. (A table's values or its optimizer state: table[5:7] or table[7:9].)
    m.def("dynemb_gather(Tensor slots, Tensor rows, Tensor rows_host, Tensor? order=None) -> Tensor");
    m.def("dynemb_scatter(Tensor slots, Tensor src, Tensor(a!) rows, Tensor(b!) rows_host, Tensor? order=None) -> ()");
    // New rows: values from the per-key initializer (init_kind: 0 none, 1 normal(a, b), 2 uniform(a, b),
    // 3 constant a), optimizer state zeroed; only where mask != 0 when given.
    m.def("dynemb_init(Tensor slots, Tensor keys, Tensor? mask, Tensor(a!)[] table, int init_kind, float a, float b, "
          "int seed) -> ()");
    // dynemb_init(slots, keys, is_new, ...) then dynemb_gather of the values (order) in one pass: returns
    // the rows (n, dim), new rows as the initializer wrote them, zeros for slot -1. order: as gather's
    // (argsort(slots): rows initialised, read and written in slot order); the result is the same as
    // without it. Keys distinct (no two entries share a slot).
    m.def("dynemb_init_gather(Tensor slots, Tensor keys, Tensor is_new, Tensor(a!)[] table, int init_kind, float a, "
          "float b, int seed, Tensor? order=None) -> Tensor");
    // One optimizer step per (unique) slot with its gradient row (opt: 0 SGD, 1 Adagrad, 2 RowWiseAdagrad, 3 Adam).
    m.def("dynemb_update(Tensor slots, Tensor grad, Tensor(a!)[] table, int opt, float lr, float eps, float beta1, "
          "float beta2, float step_size) -> ()");
    // Bags pooled straight from the table: (n_bags, dim); offsets holds n_bags + 1 entries (kernels/dynemb_kernels.h;
    // bounds clamped into the batch). inv: ids through their unique index (slots: the unique ids' slots).
    m.def("dynemb_pool(Tensor slots, Tensor offsets, Tensor? weights, Tensor rows, Tensor rows_host, bool mean, "
          "Tensor? inv=None) -> Tensor");
    // A batch's segments (its ids grouped by id), without a host sync: (perm, uniq, seg, inv, n_unique): perm lists the ids
    // group by group, each group's occurrences in batch order; uniq (n entries) and seg (n + 1) are valid
    // up to n_unique[0] (a one-element device tensor) and n_unique[0] + 1, past that uniq holds sorted
    // ids and seg holds n; inv is each id's group. On the CPU the groups come in id order (a stable sort
    // of the ids); on CUDA in the order of the ids' 32-bit hashes (a CUB radix sort with int32 values,
    // collisions put in id order after: kernels/dynemb_segments_kernels.h). For dynemb_find_or_insert_sync's n_valid.
    m.def("dynemb_sort_segments(Tensor ids) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
    // A bag batch's layout from its offsets (kernels/dynemb_segments_kernels.h): (full (n_bags + 1), bag_of (n),
    // scale (n mean-mode scales when mean, else empty), bad (one uint8 flag: offsets that do not start
    // at 0, decrease, or end elsewhere than n)). Defined, in-range results for any offsets. with_bags
    // false: bag_of and scale empty, not computed (the inference path pools from full alone).
    m.def("dynemb_bag_layout(Tensor offsets, int n, bool include_last_offset, bool mean, bool with_bags=True) "
          "-> (Tensor, Tensor, Tensor, Tensor)");
    // Per unique id, the sum of its occurrences' gradient rows in perm order (fp32, deterministic).
    m.def("dynemb_segment_sum(Tensor grad, Tensor perm, Tensor seg, Tensor? bag_of, Tensor? scale) -> Tensor");
    // dynemb_update(slots, dynemb_segment_sum(...)) in one: on CUDA the sums are applied as they are
    // made, never written out (rows of at most 128 columns; wider rows take the two ops).
    m.def("dynemb_segment_update(Tensor grad, Tensor perm, Tensor seg, Tensor? bag_of, Tensor? scale, Tensor slots, "
          "Tensor(a!)[] table, int opt, float lr, float eps, float beta1, float beta2, float step_size) -> ()");
    // (rows, cols) of `dtype` in pinned host memory mapped into `like`'s GPU (cudaHostAlloc, mapped):
    // the host tier of a CUDA table. CUDA only.
    m.def("dynemb_host_rows(Tensor like, int rows, int cols, ScalarType dtype) -> Tensor");
    // find-or-insert of distinct keys (required) with the row work folded in (kernels/dynemb_kernels.h,
    // tf_dynemb_foi_params), the host's wait for the counts and the eviction row work
    // (tf_dynemb_evict_params: the evicting keys' initial rows written over the victims' once those are
    // copied out) in one call; policy -1: no touch. Returns (slots, rows (n or 0 x dim), is_new,
    // evicted (4, n_evicted): the victims' keys, slots, scores and the indices of the keys that took
    // their slots; the victims' values; their optimizer state; the counts (inserted, n_evicted, failed,
    // keys taken, aborted) on the CPU). Every output
    // is complete when the op returns (with 128-slot buckets on CUDA the host waits for the insert
    // kernel's counts in mapped memory, which its last block writes after every block's work). A
    // table with host rows gets its evictions sorted by victim slot (the eviction rows visit host rows
    // in address order); otherwise they are in no particular order.
    // keep_evicted=False (a caller that keeps no record of evictions): the kernels write the evicting
    // keys' rows over the victims', with no row work after the wait; the list and the victims' values
    // and state come back with 0 entries (the counts still say how many were evicted).
    m.def("dynemb_find_or_insert_sync(Tensor query, Tensor(a!)[] table, int epoch, bool allow_evict, int policy, "
          "int clock, int init_kind, float a, float b, int seed, bool with_rows, Tensor? n_valid=None, "
          "Tensor? abort=None, bool keep_evicted=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
    // dynemb_find_or_insert_sync, then the batch's bags pooled from the keys' slots (dynemb_pool with
    // inv): on CUDA the pool is queued before the host's wait, and queued again after the eviction row
    // work when keys were evicted. The eighth output is the pooled bags.
    m.def("dynemb_find_or_insert_pool(Tensor query, Tensor(a!)[] table, int epoch, bool allow_evict, int policy, "
          "int clock, int init_kind, float a, float b, int seed, bool with_rows, Tensor? n_valid, Tensor? abort, "
          "Tensor pool_offsets, Tensor pool_inv, Tensor? pool_weights, bool pool_mean, bool keep_evicted=True) "
          "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
    // Table-batched forms (a collection's tables in one launch each, as FBGEMM's TBE): the items of
    // the batch (keys, bags) are concatenated, table t owning [starts[t], starts[t + 1]); `tables`
    // holds each table's state list one after another (9 entries per table, as `table` above); every
    // other list has one entry per table, and each table's part means what the single-table op means.
    m.def("dynemb_tables_lookup(Tensor query, int[] starts, Tensor(a!)[] tables, int[] epochs) -> Tensor");
    // counts: (tables, 3); table t's evicted entries start at starts[t] of evicted_*.
    m.def("dynemb_tables_insert(Tensor query, Tensor(a!) slots, int[] starts, Tensor(b!)[] tables, int[] epochs, "
          "bool[] allow_evict) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
    m.def("dynemb_tables_init(Tensor slots, Tensor keys, Tensor? mask, int[] starts, Tensor(a!)[] tables, "
          "int[] init_kinds, float[] a, float[] b, int[] seeds) -> ()");
    m.def("dynemb_tables_touch(Tensor(a!)[] tables, Tensor slots, int[] starts, int[] policies, int[] clocks) -> ()");
    // Same optimizer (opt, lr, eps, betas) for every table; Adam's step size per table.
    m.def("dynemb_tables_update(Tensor slots, Tensor grad, int[] starts, Tensor(a!)[] tables, int opt, float lr, "
          "float eps, float beta1, float beta2, float[] step_sizes) -> ()");
    // A collection's bags: offsets (sum(features) * batch + 1) in (table, feature, sample) order; returns
    // the float32 (batch, sum over t of features[t] * dim[t]) values of a TorchRec KeyedTensor.
    m.def("dynemb_tables_pool(Tensor slots, Tensor offsets, Tensor? weights, int batch, int[] features, "
          "Tensor[] tables, bool[] mean) -> Tensor");

    // ---- sampled softmax loss (python/torchfuse/losses.py; semantics: kernels/sampled_softmax.h) ----
    // negatives (R, D) shared by all T rows or (T, R, D) per row; ids mask a negative equal to the row's
    // positive; chunk_rows: rows of a (rows x R) similarity block at once (0: automatic). Returns the
    // 0-dim float32 loss and the per-row losses (float32, T) that the backward takes.
    m.def(
        "sampled_softmax_fwd(Tensor query, Tensor positive, Tensor negatives, Tensor? positive_ids, "
        "Tensor? negative_ids, Tensor? weights, float temperature, bool l2_norm, float eps, int chunk_rows) "
        "-> (Tensor, Tensor)");
    // Gradients of sampled_softmax_fwd's loss: (dquery, dpositive, dnegatives).
    m.def(
        "sampled_softmax_bwd(Tensor dloss, Tensor query, Tensor positive, Tensor negatives, Tensor? positive_ids, "
        "Tensor? negative_ids, Tensor? weights, Tensor row_loss, float temperature, bool l2_norm, float eps, "
        "int chunk_rows) -> (Tensor, Tensor, Tensor)");

    // ---- HSTU output section (python/torchfuse/hstu_output.py; semantics: kernels/hstu_output_kernels.h) ----
    // The norm-mul-concat-dropout of generative-recommenders' hstu_compute_output before its GEMM. groups: 0
    // (LayerNorm over the row) or num_heads (GroupNorm); mul_act / cat_act: 0 none, 1 SiLU, 2 sigmoid (the
    // multiplying u's and the concatenated u's). dropout_ratio 0: no dropout. The mask comes from rng_state
    // (a forward's) when given, else from seed, else from torch's generator. Returns (y, mean, rstd,
    // rng_state): y (L, (1 + concat_u + concat_x) * n), statistics (L, max(groups, 1)) float32, (seed, offset) int64.
    // Seeded from the generator: tagged so that compilers neither merge nor reorder two calls.
    m.def(
        "hstu_output_fwd(Tensor attn, Tensor u, Tensor weight, Tensor bias, float eps, int groups, int mul_act, "
        "int cat_act, bool concat_u, bool concat_x, float dropout_ratio, int? seed=None, Tensor? rng_state=None) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
    // Gradients of hstu_output_fwd's y: (dattn, du, dweight, dbias, y); dweight/dbias empty unless
    // weight_grad; y, the forward's y written again bit for bit (recompute_y_in_backward: one pass over attn
    // and u for both), empty unless recompute_y.
    m.def(
        "hstu_output_bwd(Tensor dy, Tensor attn, Tensor u, Tensor weight, Tensor bias, Tensor mean, Tensor rstd, "
        "Tensor rng_state, int groups, int mul_act, int cat_act, bool concat_u, bool concat_x, float dropout_ratio, "
        "bool weight_grad, bool recompute_y=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");

    // ---- skinny linear (python/torchfuse/skinny_linear.py; semantics: kernels/skinny_linear_kernels.h) ----
    // [LayerNorm(a) with norm_weight, norm_bias, eps] @ weight + bias + residual for a of at most 8 rows.
    m.def(
        "skinny_linear(Tensor a, Tensor weight, Tensor? bias=None, Tensor? residual=None, Tensor? norm_weight=None, "
        "Tensor? norm_bias=None, float eps=1e-5) -> Tensor");
    // hstu_output_fwd's y (groups 0, no dropout) and x + y @ output_weight in one kernel for attn of at most 8
    // rows (hstu_compute_output's serving path): y is built in the GEMM's prologue, never stored.
    m.def(
        "hstu_output_skinny(Tensor attn, Tensor u, Tensor x, Tensor norm_weight, Tensor norm_bias, float eps, "
        "Tensor output_weight, int mul_act, int cat_act, bool concat_u, bool concat_x) -> Tensor");
}
