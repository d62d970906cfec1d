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

    // ---- HSTU attention (python/torchfuse/hstu.py) ----
    // out = (M . SiLU(alpha (q k^T + attn_bias))) / S @ v per jagged sequence; delta > 0: q holds the
    // last delta query rows of every sequence (cached inference). kernels/hstu.h has the semantics.
    // validate: check offsets / lengths / targets on the host (a device-to-host copy, so a sync on a GPU);
    // without it the caller guarantees them and outputs start zeroed.
    m.def(
        "hstu_fwd(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, Tensor? attn_bias, "
        "int max_seq_len, float alpha, int? scaling_seqlen, int contextual_seq_len, int max_attn_len, "
        "int min_full_attn_seq_len, int target_group_size, int delta, bool validate=True) -> Tensor");
    // Gradients of hstu_fwd (delta = 0): (dq, dk, dv, dattn_bias); dattn_bias empty unless bias_grad.
    m.def(
        "hstu_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, "
        "Tensor? attn_bias, int max_seq_len, float alpha, int? scaling_seqlen, int contextual_seq_len, "
        "int max_attn_len, int min_full_attn_seq_len, int target_group_size, bool bias_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor)");

    // ---- dynamic embeddings (python/torchfuse/dynamic_embedding.py) ----

}
