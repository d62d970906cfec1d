"""Patch HuggingFace transformers models in place so their norms and residual adds run on torchfuse's
fused kernels (``torchfuse.layer_norm`` / ``rms_norm``); attention and MLP stay HF's.

    torchfuse.patch_hf(model)                  # a built model: its decoder layers and final norm
    torchfuse.patch_hf(model_type="llama")     # models of that type built afterwards
    torchfuse.unpatch_hf(model)                # back to HF's own forwards
    with torchfuse.stats() as calls:           # check that the kernels ran
        model(input_ids)
    assert calls == torchfuse.hf.expected_calls(model)

Per model type (as linkedin/Liger-Kernel's monkey_patch does), the patch replaces each decoder layer's
``forward`` and the final norm's ``forward`` on the instances (``unpatch_hf`` puts back what was
there: the class methods bit for bit, or an instance forward another library set, such as Liger's).
The class-level patch wraps the type's base model ``__init__`` (``LlamaModel``, ``GPTNeoXModel``,
...), which every head class builds, so a model built afterwards (``from_config``,
``from_pretrained``) is patched when built. See ``_layers`` for the
forwards and the inference-time fusion across layer boundaries.
"""
import functools
import importlib
import sys
import types
import warnings

import torch

from ..norm import LAYER_NORM, RMS_NORM_LLAMA
from . import _forms, _layers

# The releases tested: 5.17.0 through 5.24.x (CI runs tests/test_hf.py against both ends; 5.24 renamed
# the layers' past_key_values argument to cache). 5.0-5.16 have other layer signatures
# (cache_position, tuple outputs) and are refused. A newer release is patched where its layer and norm
# forwards still have the forms of the tested ones (_forms.py), else as far as can be verified.
TRANSFORMERS_TESTED = ((5, 17), (5, 24))

# model_type -> (module, base model class, layer class, norm class name or None for nn.LayerNorm,
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

_PATCHED = "_torchfuse_hf"  # attribute on a patched base model: its _State
_class_patches = {}  # model_type -> (base model class, original __init__)
_warned = set()


class _State(tuple):
    """What patch_hf did to one base model: ``(model_type, layers, final norm module, mode, saved)``;
    mode "fused" (layers and final norm) or "norms" (norm modules only); saved lists each module whose
    ``forward`` was set with the instance forward it had before (None: its class's), for unpatch_hf."""


def _version():
    """(transformers version string, whether it is newer than every tested release); raises for
    releases older than the tested ones."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("torchfuse.patch_hf needs transformers (pip install 'transformers>=5.17')") from e
    v = transformers.__version__
    parts = tuple(int(p) for p in v.split(".")[:2] if p.isdigit())
    lo, hi = TRANSFORMERS_TESTED
    if len(parts) < 2 or parts < lo:
        raise RuntimeError(
            f"torchfuse.patch_hf supports transformers >={lo[0]}.{lo[1]} (tested through {hi[0]}.{hi[1]}; the "
            f"decoder layer code it mirrors); found transformers {v}"
        )
    return v, parts > hi


def _spec(model_type):
    spec = _SPECS.get(model_type)
    if spec is None:
        raise ValueError(
            f"torchfuse.patch_hf: model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    mod = importlib.import_module(f"transformers.models.{spec[0]}.modeling_{spec[0]}")
    return mod, getattr(mod, spec[1]), getattr(mod, spec[2]), spec


def _liger_rms_forward():
    """LigerRMSNorm.forward when Liger-Kernel is loaded (only then can a module carry it), else None."""
    m = sys.modules.get("liger_kernel.transformers.rms_norm")
    cls = getattr(m, "LigerRMSNorm", None)
    return getattr(cls, "forward", None)


class _Unverified(Exception):
    """An HF norm class whose forward no longer has the tested form (a newer transformers)."""


def _norm(module, spec, mod, where, newer):
    """Wrap one norm after checking it computes what the ops reproduce: HF's own norm class, or (RMS
    families) Liger-Kernel's LigerRMSNorm in its Llama form, put in by apply_liger_kernel_to_* either as
    the class or as an instance forward; raises for anything else."""
    own = module.__dict__.get("forward")
    if spec[3] is None:
        if own is not None or type(module).forward is not torch.nn.LayerNorm.forward:
            raise TypeError(f"torchfuse.patch_hf: {where} is {type(module).__name__} with its own forward; expected "
                            f"LayerNorm")
        if len(module.normalized_shape) != 1:
            raise ValueError(f"torchfuse.patch_hf: {where} normalizes {module.normalized_shape}; expected one dim")
        return _layers.Norm(module, LAYER_NORM, module.eps)
    fwd = getattr(own, "__func__", own) if own is not None else type(module).forward
    liger = _liger_rms_forward()
    if liger is not None and fwd is liger:
        offset, cast = getattr(module, "offset", 0.0), getattr(module, "casting_mode", "llama")
        if offset != 0.0 or cast != "llama":
            raise ValueError(f"torchfuse.patch_hf: {where} is Liger's RMSNorm with offset={offset}, casting_mode="
                             f"{cast!r}; the {spec[3]} form is offset 0, casting_mode 'llama'")
    elif own is None and type(module).__name__ == spec[3] and type(module).__module__ == mod.__name__:
        if newer and not _forms.is_known(type(module).forward, "rms_norm"):
            raise _Unverified(f"{spec[3]}.forward")
    else:
        raise TypeError(f"torchfuse.patch_hf: {where} is {type(module).__name__} with its own forward; expected "
                        f"{spec[3]} (or Liger-Kernel's LigerRMSNorm)")
    if module.weight is None or module.weight.dim() != 1:
        raise ValueError(f"torchfuse.patch_hf: {where} needs a 1-D weight")
    return _layers.Norm(module, RMS_NORM_LLAMA, module.variance_epsilon)


def _left_unfused(version, model_type, what, strict):
    msg = (f"torchfuse.patch_hf: transformers {version} is newer than the releases tested "
           f"({TRANSFORMERS_TESTED[0][0]}.{TRANSFORMERS_TESTED[0][1]}-{TRANSFORMERS_TESTED[1][0]}."
           f"{TRANSFORMERS_TESTED[1][1]}) and {what}")
    if strict:
        raise RuntimeError(msg + " (strict=True)")
    key = (version, model_type, what)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg + "; pass strict=True to raise instead", RuntimeWarning, stacklevel=4)


def _patch_base(base, model_type, mod, layer_cls, spec, strict=False):
    version, newer = _version()
    if getattr(base, _PATCHED, None) is not None:
        _unpatch_base(base)
    family, layers = spec[6], getattr(base, spec[4])
    if len(layers) == 0:
        raise ValueError("torchfuse.patch_hf: the model has no decoder layers")
    cache_kw = _forms.cache_arg(layer_cls.forward)
    plan = []  # (layer, consumer norms of its input, its other norms)
    try:
        for i, layer in enumerate(layers):
            where = f"{spec[4]}[{i}]"
            if type(layer).forward is not layer_cls.forward or "forward" in layer.__dict__:
                raise TypeError(f"torchfuse.patch_hf: {where} is {type(layer).__name__} with its own forward; "
                                f"expected {layer_cls.__name__}")
            if family == "rms":
                n_in = _norm(layer.input_layernorm, spec, mod, where + ".input_layernorm", newer)
                n_post = _norm(layer.post_attention_layernorm, spec, mod, where + ".post_attention_layernorm", newer)
                plan.append((layer, [n_in], (n_post,)))
            elif family == "neox":
                n_in = _norm(layer.input_layernorm, spec, mod, where + ".input_layernorm", newer)
                n_post = _norm(layer.post_attention_layernorm, spec, mod, where + ".post_attention_layernorm", newer)
                if layer.use_parallel_residual and n_in.eps != n_post.eps:
                    raise ValueError(f"torchfuse.patch_hf: {where}: the parallel residual's two norms have "
                                     f"different eps")
                plan.append((layer, [n_in, n_post] if layer.use_parallel_residual else [n_in], (n_post,)))
            else:
                n_1 = _norm(layer.ln_1, spec, mod, where + ".ln_1", newer)
                n_2 = _norm(layer.ln_2, spec, mod, where + ".ln_2", newer)
                n_c = _norm(layer.ln_cross_attn, spec, mod, where + ".ln_cross_attn", newer) \
                    if hasattr(layer, "ln_cross_attn") else None
                plan.append((layer, [n_1], (n_2, n_c)))
        final = _norm(getattr(base, spec[5]), spec, mod, spec[5], newer)
    except _Unverified as e:
        _left_unfused(version, model_type, f"{e} differs from the form torchfuse reproduces: nothing was patched",
                      strict)
        return
    fused = not newer or (_forms.is_known(layer_cls.forward, family) and (family == "neox" or cache_kw is not None))
    saved = []

    def put(module, forward):
        saved.append((module, module.__dict__.get("forward")))
        module.forward = types.MethodType(forward, module)

    if not fused:
        _left_unfused(version, model_type, f"{layer_cls.__name__}.forward differs from the form torchfuse mirrors: its "
                      f"norms run on torchfuse's norm kernels, its residual adds stay HF's (not fused)", strict)
        for layer, consumer, others in plan:
            for n in {id(n): n for n in (*consumer, *others) if n is not None}.values():
                put(n.module, _layers.norm_only_forward(n))
        put(final.module, _layers.norm_only_forward(final))
        object.__setattr__(base, _PATCHED, _State((model_type, [p[0] for p in plan], final.module, "norms", saved)))
        return
    for i, (layer, consumer, others) in enumerate(plan):
        emit = _layers.make_emit(plan[i + 1][1] if i + 1 < len(plan) else [final])
        if family == "rms":
            put(layer, _layers.rms_layer_forward(layer, consumer[0], others[0], emit, cache_kw))
        elif family == "neox":
            put(layer, _layers.neox_layer_forward(layer, consumer[0], others[0], emit))
        else:
            put(layer, _layers.gpt2_block_forward(layer, consumer[0], others[0], others[1], emit, cache_kw))
    put(final.module, _layers.final_norm_forward(final))
    object.__setattr__(base, _PATCHED, _State((model_type, [p[0] for p in plan], final.module, "fused", saved)))


def _unpatch_base(base):
    state = getattr(base, _PATCHED, None)
    if state is None:
        return
    for module, before in reversed(state[4]):
        if before is None:
            module.__dict__.pop("forward", None)
        else:  # an instance forward put there before patch_hf (Liger-Kernel's, on a norm)
            module.__dict__["forward"] = before
    object.__delattr__(base, _PATCHED)


def _bases(model, base_cls):
    found = [m for m in model.modules() if isinstance(m, base_cls)]
    if not found:
        raise TypeError(f"torchfuse.patch_hf: no {base_cls.__name__} inside {type(model).__name__}")
    return found


def patch_hf(model=None, *, model_type=None, strict=False):
    """Run a HuggingFace model's norms and residual adds on torchfuse's fused kernels.

    ``patch_hf(model)`` patches a built model in place (every ``<Type>Model`` inside it: its decoder
    layers and final norm), dispatching on ``model.config.model_type``, and returns the model.
    ``patch_hf(model_type="llama")`` patches the transformers classes so that models of that type built
    afterwards are patched when built. Supported: ``torchfuse.hf.SUPPORTED`` (GPT-NeoX with parallel
    or sequential residual, Llama, Mistral, Qwen2, Qwen3, GPT-2); any other type raises ValueError.

    transformers 5.17 through 5.24 are tested. On a newer release the layers are patched where their
    HF forward still has the tested form; where it does not, the norms alone run on the fused kernels
    (the adds stay HF's), and where the norm's own forward changed nothing is patched; each such case
    warns once, naming the version and what was left unfused. ``strict=True`` raises instead.

    Works after Liger-Kernel's ``apply_liger_kernel_to_<model>(...)``: its RMSNorm modules (class or
    instance forward) are taken over like HF's; its RoPE, SwiGLU MLP and loss stay in place.

    Outputs: every residual sum is bit-identical to HF's (same add order, each add rounded); norm
    outputs may differ from PyTorch's by rounding. The norm weights must have the activations' dtype
    (a model cast with ``.to(dtype)`` / ``dtype=``). Forward hooks on the patched norm modules do not
    fire (the layer calls the ops directly); hooks on layers, attention and MLP do.
    """
    _version()
    if model is None:
        if model_type is None:
            raise TypeError("torchfuse.patch_hf: pass a model or model_type=")
        _patch_class(model_type, strict)
        return None
    if not isinstance(model, torch.nn.Module) or not isinstance(getattr(getattr(model, "config", None), "model_type",
                                                                        None), str):
        raise TypeError(f"torchfuse.patch_hf: model must be a transformers PreTrainedModel (a torch.nn.Module with "
                        f"config.model_type), got {type(model).__name__}")
    if model_type is not None and model_type != model.config.model_type:
        raise ValueError(f"torchfuse.patch_hf: model_type={model_type!r} but the model is "
                         f"{model.config.model_type!r}")
    model_type = model.config.model_type
    mod, base_cls, layer_cls, spec = _spec(model_type)
    for base in _bases(model, base_cls):
        _patch_base(base, model_type, mod, layer_cls, spec, strict)
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


def _patch_class(model_type, strict=False):
    mod, base_cls, layer_cls, spec = _spec(model_type)
    if model_type in _class_patches:
        return
    orig_init = base_cls.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        # subclasses of another model type that reuse this __init__ are left alone
        if getattr(getattr(self, "config", None), "model_type", None) == model_type:
            _patch_base(self, model_type, mod, layer_cls, spec, strict)

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
    cross-attention 1 more per layer. A model patched on its norms only (a newer transformers whose
    layer forward changed): one per norm module, no ``hf_layer`` / ``hf_final_norm``.

        with torchfuse.stats() as calls:
            model(input_ids)
        assert calls == torchfuse.hf.expected_calls(model)
    """
    calls = {"hf_layer": 0, "hf_final_norm": 0, "norm_fwd": 0}
    for m in model.modules():
        state = getattr(m, _PATCHED, None)
        if state is None:
            continue
        model_type, layers, _, mode, _ = state
        per = 2
        if model_type == "gpt_neox" and layers[0].use_parallel_residual and mode == "fused":
            per = 1
        if model_type == "gpt2" and cross_attention:
            per = 3
        calls["norm_fwd"] += per * len(layers) + 1
        if mode == "fused":
            calls["hf_layer"] += len(layers)
            calls["hf_final_norm"] += 1
    return {k: v for k, v in calls.items() if v or k == "norm_fwd"}
