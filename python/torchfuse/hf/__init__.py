"""Patch HuggingFace transformers models in place so their norms and residual adds run on torchfuse's
fused kernels (``torchfuse.layer_norm`` / ``rms_norm``); attention and MLP stay HF's.

    torchfuse.patch_hf(model)                  # a built model: its decoder layers and final norm
    torchfuse.patch_hf(model_type="llama")     # models of that type built afterwards
    torchfuse.unpatch_hf(model)                # back to HF's own forwards
    with torchfuse.stats() as calls:           # check that the kernels ran
        model(input_ids)
    assert calls == torchfuse.hf.expected_calls(model)

Per model type (as linkedin/Liger-Kernel's monkey_patch does), the patch replaces each decoder layer's
``forward`` and the final norm's ``forward`` on the instances (``unpatch_hf`` deletes them again, so
the class methods are back bit for bit). The class-level patch wraps the type's base model
``__init__`` (``LlamaModel``, ``GPTNeoXModel``, ...), which every head class builds, so a model built
afterwards (``from_config``, ``from_pretrained``) is patched when built. See ``_layers`` for the
forwards and the inference-time fusion across layer boundaries.
"""
import functools
import importlib
import types

import torch

from ..norm import LAYER_NORM, RMS_NORM_LLAMA
from . import _layers

# Tested with 5.17 (the decoder layer and norm code is unchanged through 5.23); 5.0-5.16 have other
# layer signatures (cache_position, tuple outputs).
TRANSFORMERS_RANGE = ((5, 17), (5, 24))

# model_type -> (module, base model class, layer class, norm class or None for nn.LayerNorm,
#                layers attribute, final norm attribute, family)
_SPECS = {
    "llama": ("llama", "LlamaModel", "LlamaDecoderLayer", "LlamaRMSNorm", "layers", "norm", "rms"),
    "mistral": ("mistral", "MistralModel", "MistralDecoderLayer", "MistralRMSNorm", "layers", "norm", "rms"),
    "qwen2": ("qwen2", "Qwen2Model", "Qwen2DecoderLayer", "Qwen2RMSNorm", "layers", "norm", "rms"),
    "qwen3": ("qwen3", "Qwen3Model", "Qwen3DecoderLayer", "Qwen3RMSNorm", "layers", "norm", "rms"),
    "gpt_neox": ("gpt_neox", "GPTNeoXModel", "GPTNeoXLayer", None, "layers", "final_layer_norm", "neox"),
    "gpt2": ("gpt2", "GPT2Model", "GPT2Block", None, "h", "ln_f", "gpt2"),
}
SUPPORTED = tuple(_SPECS)

_PATCHED = "_torchfuse_hf"  # attribute on a patched base model: its model_type
_class_patches = {}  # model_type -> original base model __init__


def _check_version():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("torchfuse.patch_hf needs transformers (pip install 'transformers>=5.17,<5.24')") from e
    v = transformers.__version__
    parts = tuple(int(p) for p in v.split(".")[:2] if p.isdigit())
    lo, hi = TRANSFORMERS_RANGE
    if len(parts) < 2 or not (lo <= parts < hi):
        raise RuntimeError(
            f"torchfuse.patch_hf supports transformers >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} (the decoder layer "
            f"code it mirrors); found transformers {v}"
        )
    return transformers


def _spec(model_type):
    spec = _SPECS.get(model_type)
    if spec is None:
        raise ValueError(
            f"torchfuse.patch_hf: model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    mod = importlib.import_module(f"transformers.models.{spec[0]}.modeling_{spec[0]}")
    return mod, getattr(mod, spec[1]), getattr(mod, spec[2]), (getattr(mod, spec[3]) if spec[3] else torch.nn.LayerNorm), spec


def _norm(module, norm_cls, where):
    """Wrap one HF norm after checking it is exactly the module whose math the ops reproduce."""
    if type(module).forward is not norm_cls.forward or "forward" in module.__dict__:
        raise TypeError(f"torchfuse.patch_hf: {where} is {type(module).__name__} with its own forward; expected "
                        f"{norm_cls.__name__}")
    if norm_cls is torch.nn.LayerNorm:
        if len(module.normalized_shape) != 1:
            raise ValueError(f"torchfuse.patch_hf: {where} normalizes {module.normalized_shape}; expected one dim")
        return _layers.Norm(module, LAYER_NORM, module.eps)
    if module.weight is None or module.weight.dim() != 1:
        raise ValueError(f"torchfuse.patch_hf: {where} needs a 1-D weight")
    return _layers.Norm(module, RMS_NORM_LLAMA, module.variance_epsilon)


def _patch_base(base, model_type, mod, layer_cls, norm_cls, spec):
    if getattr(base, _PATCHED, None) is not None:
        _unpatch_base(base)
    family, layers = spec[6], getattr(base, spec[4])
    if len(layers) == 0:
        raise ValueError("torchfuse.patch_hf: the model has no decoder layers")
    plan = []  # (layer, consumer norms of its input, its other norms)
    for i, layer in enumerate(layers):
        where = f"{spec[4]}[{i}]"
        if type(layer).forward is not layer_cls.forward or "forward" in layer.__dict__:
            raise TypeError(f"torchfuse.patch_hf: {where} is {type(layer).__name__} with its own forward; expected "
                            f"{layer_cls.__name__}")
        if family == "rms":
            n_in = _norm(layer.input_layernorm, norm_cls, where + ".input_layernorm")
            n_post = _norm(layer.post_attention_layernorm, norm_cls, where + ".post_attention_layernorm")
            plan.append((layer, [n_in], (n_post,)))
        elif family == "neox":
            n_in = _norm(layer.input_layernorm, norm_cls, where + ".input_layernorm")
            n_post = _norm(layer.post_attention_layernorm, norm_cls, where + ".post_attention_layernorm")
            if layer.use_parallel_residual and n_in.eps != n_post.eps:
                raise ValueError(f"torchfuse.patch_hf: {where}: the parallel residual's two norms have different eps")
            plan.append((layer, [n_in, n_post] if layer.use_parallel_residual else [n_in], (n_post,)))
        else:
            n_1 = _norm(layer.ln_1, norm_cls, where + ".ln_1")
            n_2 = _norm(layer.ln_2, norm_cls, where + ".ln_2")
            n_c = _norm(layer.ln_cross_attn, norm_cls, where + ".ln_cross_attn") if hasattr(layer, "ln_cross_attn") \
                else None
            plan.append((layer, [n_1], (n_2, n_c)))
    final = _norm(getattr(base, spec[5]), norm_cls, spec[5])
    for i, (layer, consumer, others) in enumerate(plan):
        emit = _layers.make_emit(plan[i + 1][1] if i + 1 < len(plan) else [final])
        if family == "rms":
            layer.forward = types.MethodType(_layers.rms_layer_forward(layer, consumer[0], others[0], emit), layer)
        elif family == "neox":
            layer.forward = types.MethodType(_layers.neox_layer_forward(layer, consumer[0], others[0], emit), layer)
        else:
            layer.forward = types.MethodType(_layers.gpt2_block_forward(layer, consumer[0], others[0], others[1], emit),
                                             layer)
    final.module.forward = types.MethodType(_layers.final_norm_forward(final), final.module)
    object.__setattr__(base, _PATCHED, (model_type, [p[0] for p in plan], final.module))


def _unpatch_base(base):
    state = getattr(base, _PATCHED, None)
    if state is None:
        return
    _, layers, final = state
    for m in (*layers, final):
        m.__dict__.pop("forward", None)
    object.__delattr__(base, _PATCHED)


def _bases(model, base_cls):
    found = [m for m in model.modules() if isinstance(m, base_cls)]
    if not found:
        raise TypeError(f"torchfuse.patch_hf: no {base_cls.__name__} inside {type(model).__name__}")
    return found


def patch_hf(model=None, *, model_type=None):
    """Run a HuggingFace model's norms and residual adds on torchfuse's fused kernels.

    ``patch_hf(model)`` patches a built model in place (every ``<Type>Model`` inside it: its decoder
    layers and final norm), dispatching on ``model.config.model_type``, and returns the model.
    ``patch_hf(model_type="llama")`` patches the transformers classes so that models of that type built
    afterwards are patched when built. Supported: ``torchfuse.hf.SUPPORTED`` (GPT-NeoX with parallel
    or sequential residual, Llama, Mistral, Qwen2, Qwen3, GPT-2); any other type raises ValueError.

    Outputs: every residual sum is bit-identical to HF's (same add order, each add rounded); norm
    outputs may differ from PyTorch's by rounding. The norm weights must have the activations' dtype
    (a model cast with ``.to(dtype)`` / ``dtype=``). Forward hooks on the patched norm modules do not
    fire (the layer calls the ops directly); hooks on layers, attention and MLP do.
    """
    _check_version()
    if model is None:
        if model_type is None:
            raise TypeError("torchfuse.patch_hf: pass a model or model_type=")
        _patch_class(model_type)
        return None
    if not isinstance(model, torch.nn.Module) or not isinstance(getattr(getattr(model, "config", None), "model_type",
                                                                        None), str):
        raise TypeError(f"torchfuse.patch_hf: model must be a transformers PreTrainedModel (a torch.nn.Module with "
                        f"config.model_type), got {type(model).__name__}")
    if model_type is not None and model_type != model.config.model_type:
        raise ValueError(f"torchfuse.patch_hf: model_type={model_type!r} but the model is "
                         f"{model.config.model_type!r}")
    model_type = model.config.model_type
    mod, base_cls, layer_cls, norm_cls, spec = _spec(model_type)
    for base in _bases(model, base_cls):
        _patch_base(base, model_type, mod, layer_cls, norm_cls, spec)
    return model


def unpatch_hf(model=None, *, model_type=None):
    """Undo :func:`patch_hf`: ``unpatch_hf(model)`` restores a model's own forwards (outputs bit for
    bit as before patching); ``unpatch_hf(model_type="llama")`` stops patching models built afterwards;
    ``unpatch_hf()`` undoes every class-level patch."""
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"torchfuse.unpatch_hf: model must be a torch.nn.Module, got {type(model).__name__}")
        found = [m for m in model.modules() if getattr(m, _PATCHED, None) is not None]
        for base in found:
            _unpatch_base(base)
        return model
    for t in ([model_type] if model_type is not None else list(_class_patches)):
        orig = _class_patches.pop(t, None)
        if orig is not None:
            orig[0].__init__ = orig[1]
    return None


def _patch_class(model_type):
    mod, base_cls, layer_cls, norm_cls, spec = _spec(model_type)
    if model_type in _class_patches:
        return
    orig_init = base_cls.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        # subclasses of another model type that reuse this __init__ are left alone
        if getattr(getattr(self, "config", None), "model_type", None) == model_type:
            _patch_base(self, model_type, mod, layer_cls, norm_cls, spec)

    base_cls.__init__ = __init__
    _class_patches[model_type] = (base_cls, orig_init)


def is_patched(model):
    """Whether any base model inside ``model`` is patched."""
    return any(getattr(m, _PATCHED, None) is not None for m in model.modules())


def expected_calls(model, cross_attention=False):
    """What ``torchfuse.stats()`` counts in one forward of a patched ``model`` (both paths count the
    same): ``hf_layer`` (patched layer forwards run), ``hf_final_norm`` (patched final norms run) and
    ``norm_fwd`` (fused kernel calls): per layer 2 (Llama family, GPT-2, GPT-NeoX sequential) or 1
    (GPT-NeoX parallel: one kernel does the layer's 3-way add and both of the next layer's norms), plus 1
    per model (the first layer's input norm; the final norm comes with the last layer's add); GPT-2 with
    cross-attention 1 more per layer.

        with torchfuse.stats() as calls:
            model(input_ids)
        assert calls == torchfuse.hf.expected_calls(model)
    """
    calls = {"hf_layer": 0, "hf_final_norm": 0, "norm_fwd": 0}
    for m in model.modules():
        state = getattr(m, _PATCHED, None)
        if state is None:
            continue
        model_type, layers, _ = state
        per = 2
        if model_type == "gpt_neox" and layers[0].use_parallel_residual:
            per = 1
        if model_type == "gpt2" and cross_attention:
            per = 3
        calls["norm_fwd"] += per * len(layers) + 1
        calls["hf_layer"] += len(layers)
        calls["hf_final_norm"] += 1
    return calls
