// Every torchfuse op schema, in one place, a section per op family. Implementations register per
// device next to their code (e.g. norm.cpp: CPU, norm_cuda.cpp: CUDA); fake (meta) kernels and autograd
// are registered in Python (python/torchfuse/<family>.py).
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

    // ---- dynamic embeddings (python/torchfuse/dynamic_embedding.py) ----

}
