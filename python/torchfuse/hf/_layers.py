"""The patched forwards: HF decoder layers and final norms rewritten on the fused norm ops.

Each forward mirrors its HF original line for line (same submodule calls with the same arguments,
same add order), with every norm and residual add moved into torchfuse ops.

Two paths, chosen per call by grad mode:

* inference (grad disabled: ``generate``, ``torch.no_grad``, ``torch.inference_mode``): the residual
  add that ends layer i is fused with the norm(s) that start layer i+1 (or with the final norm), so a
  layer has no separate add at all. Layer i still returns the full hidden state ``s`` (what HF returns,
  so ``output_hidden_states`` and hooks see the same tensors); the normalized ``y`` rides along in a
  *carry* slot owned by the consumer, which uses it only if the tensor it is handed is that same ``s``
  object, unmodified (same ``_version``); otherwise it normalizes what it was given. Ops are called
  at their lowest-overhead entry (``add_norm``; ``norm_fwd`` below the autograd layer when a second
  residual or second norm is needed), which is what decides decode latency.
* training (grad enabled): fusion stays inside the layer (norm of the input; add + norm after
  attention), the closing add is eager, and the ops go through the differentiable public API. Nothing
  crosses a layer boundary, so gradient checkpointing and recomputation see plain layers.

Closures capture the modules' ``_parameters`` / ``_modules`` dicts, not the tensors, so parameters
replaced later (loading weights, ``.to()``) and submodules swapped later (adapters) are honoured. The
forwards are methods bound to their module, so a ``copy.deepcopy`` of a patched model gets methods
bound to the copies, which refuse to run (they would run the original's submodules) until the copy
is patched itself.
"""
import torch

from .._stats import count
from ..norm import LAYER_NORM, RMS_NORM_LLAMA, layer_norm, rms_norm

_infer = torch.ops.torchfuse.add_norm.default
_fwd = torch.ops.torchfuse.norm_fwd.default
_below_autograd = torch._C._AutoDispatchBelowAutograd
_grad_enabled = torch.is_grad_enabled


class Norm:
    """One HF norm module as the ops see it: kind, eps, parameters dict, and the carry slot in which
    its producer leaves ``(s, y, y2, s._version)`` (one tuple, stored and taken whole, so threads
    sharing a model can make a consumer miss the carry, never read another call's ``y``)."""

    __slots__ = ("module", "kind", "eps", "params", "carry")

    def __init__(self, module, kind, eps):
        self.module, self.kind, self.eps = module, kind, float(eps)
        self.params = module._parameters
        self.carry = [None]

    def __call__(self, x, residual=None):
        """Training-path norm through the differentiable API (counts itself)."""
        p = self.params
        if self.kind == LAYER_NORM:
            return layer_norm(x, p["weight"], p.get("bias"), self.eps, residual=residual)
        return rms_norm(x, p["weight"], self.eps, residual=residual)


def _copied(module):
    return RuntimeError(
        f"torchfuse.patch_hf: this {type(module).__name__} is a copy (copy.deepcopy) of a patched module, whose "
        "patched forward would run the original's submodules; call torchfuse.patch_hf(copy) (or unpatch_hf) on "
        "the copied model"
    )


def _take(carry, h):
    """The carried norm output(s) for ``h`` if its producer left them, else None; empties the slot."""
    c = carry[0]
    carry[0] = None
    if c is not None and c[0] is h and h._version == c[3]:
        return c[1], c[2]
    return None


def _normed_input(carry, h, weight, bias, eps, kind):
    """The norm of ``h`` its producer carried over, else computed here (one norm, no residual)."""
    got = _take(carry, h)
    if got is not None:
        return got[0]
    count("norm_fwd")
    return _infer(h, None, weight, bias, eps, kind, 0.0)[0]


def make_emit(consumer):
    """``emit(x, r, r2)``: ``s = x + r (+ r2)`` in that order, the consumer's norm(s) of ``s`` in the
    same kernel, left in the consumer's carry; returns ``s``. Inference path only.

    ``consumer`` is a list of one Norm, or two (GPT-NeoX parallel: both norms of one hidden state,
    same kind and eps, checked when patching)."""
    n1 = consumer[0]
    p1, eps, kind, carry = n1.params, n1.eps, n1.kind, n1.carry
    if len(consumer) == 1:
        def emit(x, r, r2=None):
            count("norm_fwd")
            if r2 is None:
                y, s = _infer(x, r, p1["weight"], p1.get("bias"), eps, kind, 0.0)
            else:
                with _below_autograd():
                    y, _, s, _, _ = _fwd(x, r, r2, p1["weight"], p1.get("bias"), None, None, eps, kind, 0.0,
                                         None, False)
            carry[0] = (s, y, None, s._version)
            return s
        return emit
    p2 = consumer[1].params

    def emit2(x, r, r2=None):
        count("norm_fwd")
        with _below_autograd():
            y, y2, s, _, _ = _fwd(x, r, r2, p1["weight"], p1.get("bias"), p2["weight"], p2.get("bias"), eps, kind,
                                  0.0, None, False)
        carry[0] = (s, y, y2, s._version)
        return s
    return emit2


def final_norm_forward(norm):
    """Forward of a model's final norm: the carried output when the last layer left it."""
    carry, p, eps, kind = norm.carry, norm.params, norm.eps, norm.kind

    owner = norm.module

    def forward(self, hidden_states):
        if self is not owner:
            raise _copied(self)
        count("hf_final_norm")
        if not _grad_enabled():
            return _normed_input(carry, hidden_states, p["weight"], p.get("bias"), eps, kind)
        return norm(hidden_states)
    return forward


def rms_layer_forward(layer, n_in, n_post, emit, cache_kw):
    """Llama / Mistral / Qwen2 / Qwen3 decoder layer (HF's ``LlamaDecoderLayer.forward``); ``cache_kw``
    names the cache argument (``past_key_values`` through transformers 5.23, ``cache`` from 5.24)."""
    mods = layer._modules
    carry, p_in, eps_in = n_in.carry, n_in.params, n_in.eps
    p_post, eps_post = n_post.params, n_post.eps
    rms = RMS_NORM_LLAMA

    def run(self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, kwargs):
        if self is not layer:
            raise _copied(self)
        count("hf_layer")
        kwargs[cache_kw] = cache
        if _grad_enabled():
            x = n_in(hidden_states)
            x, _ = mods["self_attn"](hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                                     use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
            x, h = n_post(x, hidden_states)
            return h + mods["mlp"](x)
        x = _normed_input(carry, hidden_states, p_in["weight"], None, eps_in, rms)
        x, _ = mods["self_attn"](hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        count("norm_fwd")
        x, h = _infer(x, hidden_states, p_post["weight"], None, eps_post, rms, 0.0)
        return emit(mods["mlp"](x), h)

    # HF's own signature, so positional and keyword calls bind as they do on HF's layer
    if cache_kw == "cache":
        def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                    position_embeddings=None, **kwargs):
            return run(self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings,
                       kwargs)
    else:
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            return run(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                       position_embeddings, kwargs)
    return forward


def neox_layer_forward(layer, n_in, n_post, emit):
    """GPT-NeoX layer (HF's ``GPTNeoXLayer.forward``), parallel or sequential residual."""
    mods = layer._modules
    parallel = bool(layer.use_parallel_residual)
    carry, p_in, p_post, eps, ln = n_in.carry, n_in.params, n_post.params, n_in.eps, LAYER_NORM

    def forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, layer_past=None,
                position_embeddings=None, **kwargs):
        if self is not layer:
            raise _copied(self)
        count("hf_layer")
        training = layer.training  # dropout is the identity in eval: skip the module calls
        if _grad_enabled():
            if parallel:
                y1, y2 = layer_norm(hidden_states, p_in["weight"], p_in["bias"], eps,
                                    weight2=p_post["weight"], bias2=p_post["bias"])
            else:
                y1 = n_in(hidden_states)
            a, _ = mods["attention"](y1, attention_mask=attention_mask, position_ids=position_ids,
                                     layer_past=layer_past, use_cache=use_cache,
                                     position_embeddings=position_embeddings, **kwargs)
            a = mods["post_attention_dropout"](a)
            if parallel:
                m = mods["post_mlp_dropout"](mods["mlp"](y2))
                return m + a + hidden_states
            y2, a = n_post(a, hidden_states)
            return mods["post_mlp_dropout"](mods["mlp"](y2)) + a
        got = _take(carry, hidden_states)
        if got is not None:
            y1, y2 = got
        else:
            count("norm_fwd")
            if parallel:
                with _below_autograd():
                    y1, y2, _, _, _ = _fwd(hidden_states, None, None, p_in["weight"], p_in["bias"], p_post["weight"],
                                           p_post["bias"], eps, ln, 0.0, None, False)
            else:
                y1 = _infer(hidden_states, None, p_in["weight"], p_in["bias"], eps, ln, 0.0)[0]
        a, _ = mods["attention"](y1, attention_mask=attention_mask, position_ids=position_ids,
                                 layer_past=layer_past, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        if training:
            a = mods["post_attention_dropout"](a)
        if parallel:
            m = mods["mlp"](y2)
            if training:
                m = mods["post_mlp_dropout"](m)
            return emit(m, a, hidden_states)  # (mlp + attn) + hidden, as HF
        count("norm_fwd")
        y2, a = _infer(a, hidden_states, p_post["weight"], p_post["bias"], eps, ln, 0.0)
        m = mods["mlp"](y2)
        if training:
            m = mods["post_mlp_dropout"](m)
        return emit(m, a)
    return forward


def gpt2_block_forward(layer, n_1, n_2, n_cross, emit, cache_kw):
    """GPT-2 block (HF's ``GPT2Block.forward``), cross-attention included; ``cache_kw`` as for
    :func:`rms_layer_forward`."""
    mods = layer._modules
    carry, p_1, eps_1, p_2, eps_2, ln = n_1.carry, n_1.params, n_1.eps, n_2.params, n_2.eps, LAYER_NORM

    def run(self, hidden_states, cache, attention_mask, encoder_hidden_states, encoder_attention_mask, use_cache,
            kwargs):
        if self is not layer:
            raise _copied(self)
        count("hf_layer")
        if encoder_hidden_states is not None and n_cross is None:
            raise ValueError(
                f"If `encoder_hidden_states` are passed, {layer} has to be instantiated with "
                "cross-attention layers by setting `config.add_cross_attention=True`"
            )
        kwargs[cache_kw] = cache
        cross_kw = {cache_kw: cache}
        if _grad_enabled():
            x = n_1(hidden_states)
            a, _ = mods["attn"](x, attention_mask=attention_mask, use_cache=use_cache, **kwargs)
            if encoder_hidden_states is not None:
                x, h = n_cross(a, hidden_states)
                a, _ = mods["crossattention"](x, attention_mask=attention_mask,
                                              encoder_hidden_states=encoder_hidden_states,
                                              encoder_attention_mask=encoder_attention_mask, **cross_kw)
                hidden_states = h
            x, h = n_2(a, hidden_states)
            return h + mods["mlp"](x)
        x = _normed_input(carry, hidden_states, p_1["weight"], p_1["bias"], eps_1, ln)
        a, _ = mods["attn"](x, attention_mask=attention_mask, use_cache=use_cache, **kwargs)
        if encoder_hidden_states is not None:
            p_c = n_cross.params
            count("norm_fwd")
            x, hidden_states = _infer(a, hidden_states, p_c["weight"], p_c["bias"], n_cross.eps, ln, 0.0)
            a, _ = mods["crossattention"](x, attention_mask=attention_mask,
                                          encoder_hidden_states=encoder_hidden_states,
                                          encoder_attention_mask=encoder_attention_mask, **cross_kw)
        count("norm_fwd")
        x, h = _infer(a, hidden_states, p_2["weight"], p_2["bias"], eps_2, ln, 0.0)
        return emit(mods["mlp"](x), h)

    if cache_kw == "cache":
        def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                    encoder_attention_mask=None, use_cache=False, **kwargs):
            return run(self, hidden_states, cache, attention_mask, encoder_hidden_states, encoder_attention_mask,
                       use_cache, kwargs)
    else:
        def forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                    encoder_attention_mask=None, use_cache=False, **kwargs):
            return run(self, hidden_states, past_key_values, attention_mask, encoder_hidden_states,
                       encoder_attention_mask, use_cache, kwargs)
    return forward


def norm_only_forward(norm):
    """Forward of one norm module on the fused op, no residual: the fallback for layers whose HF
    forward could not be verified (their adds stay HF's)."""
    p, eps, kind, owner = norm.params, norm.eps, norm.kind, norm.module

    def forward(self, hidden_states):
        if self is not owner:
            raise _copied(self)
        if _grad_enabled():
            return norm(hidden_states)
        count("norm_fwd")
        return _infer(hidden_states, None, p["weight"], p.get("bias"), eps, kind, 0.0)[0]
    return forward
