"""Functions with the signatures and semantics of meta-recsys/generative-recommenders' ops, backed by
torchfuse, so existing code can swap them in; :func:`patch` installs them into an installed
generative_recommenders (its modules and their ``from ... import`` bindings), :func:`unpatch` undoes it.

    from torchfuse.compat import gr
    gr.patch()                      # GR's STU layers now run torchfuse's kernels, whatever kernel they select
    with torchfuse.stats() as calls:
        model(...)                  # calls["gr.hstu_preprocess_and_attention"], calls["hstu_fwd"], ...
"""

# ---- jagged tensor ops (concat_2D_jagged, split_2D_jagged) ----
from typing import Optional, Tuple  # noqa: E402

from torch import Tensor  # noqa: E402

from .. import jagged as _jagged  # noqa: E402


def concat_2D_jagged(
    max_seq_len: int,
    values_left: Tensor,
    values_right: Tensor,
    max_len_left: Optional[int] = None,
    max_len_right: Optional[int] = None,
    offsets_left: Optional[Tensor] = None,
    offsets_right: Optional[Tensor] = None,
    kernel=None,
    n_prefix_from_right: int = 0,
) -> Tensor:
    """generative_recommenders.ops.jagged_tensors.concat_2D_jagged: per sample ``[left_b; right_b]``
    (offsets None: that side is dense with max_len rows per sample). ``max_seq_len`` and ``kernel``
    are accepted for signature compatibility and not needed (the torchfuse kernel is sized by rows);
    lengths must not exceed the max_len given (GR's contract). ``n_prefix_from_right`` is the Triton
    variant's prefix argument. Returns the concatenated values only, as GR does."""
    values, _ = _jagged.concat_2d_jagged(values_left, offsets_left, values_right, offsets_right, max_len_left,
                                         max_len_right, n_prefix_from_right)
    return values


def split_2D_jagged(
    max_seq_len: int,
    values: Tensor,
    total_len_left: Optional[int] = None,
    total_len_right: Optional[int] = None,
    max_len_left: Optional[int] = None,
    max_len_right: Optional[int] = None,
    offsets_left: Optional[Tensor] = None,
    offsets_right: Optional[Tensor] = None,
    kernel=None,
    n_prefix_to_right: int = 0,
) -> Tuple[Tensor, Tensor]:
    """generative_recommenders.ops.jagged_tensors.split_2D_jagged: the inverse of concat_2D_jagged,
    returning ``(values_left, values_right)``; totals given (or a dense side) means no device sync."""
    return _jagged.split_2d_jagged(values, offsets_left, offsets_right, max_len_left, max_len_right,
                                   n_prefix_to_right, total_len_left, total_len_right)


def concat_2D_jagged_multirow(
    max_seq_len: int,
    values_left: Tensor,
    values_right: Tensor,
    offsets_left: Optional[Tensor],
    offsets_right: Optional[Tensor],
    max_len_left: int,
    max_len_right: int,
    kernel=None,
) -> Tensor:
    """generative_recommenders.ops.jagged_tensors.concat_2D_jagged_multirow: the same result as
    concat_2D_jagged (GR's variant only launches several rows per program); note its argument order."""
    return concat_2D_jagged(max_seq_len, values_left, values_right, max_len_left, max_len_right, offsets_left,
                            offsets_right)


# GR's multirow variant only launches several rows per program: the same signature and result
split_2D_jagged_multirow = split_2D_jagged


def jagged_dense_bmm_broadcast_add(max_seq_len: int, seq_offsets: Tensor, jagged: Tensor, dense: Tensor, bias: Tensor,
                                   kernel=None) -> Tensor:
    """generative_recommenders.ops.jagged_tensors.jagged_dense_bmm_broadcast_add (``kernel`` ignored):
    :func:`torchfuse.jagged_dense_bmm_broadcast_add`."""
    return _jagged.jagged_dense_bmm_broadcast_add(max_seq_len, seq_offsets, jagged, dense, bias)


# ---- HSTU attention (hstu_mha, delta_hstu_mha) ----
from typing import Optional as _Optional

import torch as _torch

from ..hstu import hstu_attention as _hstu_attention
from ..hstu import hstu_attention_cached as _hstu_attention_cached


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    seq_offsets: _torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: _Optional[_torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    sort_by_length: bool = False,
    kernel=None,
    enable_tma: bool = False,
) -> _torch.Tensor:
    """generative-recommenders' ``hstu_mha`` (same signature and semantics), on
    :func:`torchfuse.hstu_attention`: any head dims up to 256, and attention dropout (``dropout_pr``
    applied when ``training``, as GR's PyTorch form does, with the mask drawn from torch's generator).
    ``sort_by_length``, ``kernel`` and ``enable_tma`` are accepted and ignored (the kernels schedule long
    sequences first themselves and choose their loads). Not supported: ``causal=False``
    (NotImplementedError, as GR's own kernels)."""
    if not causal:
        raise NotImplementedError("torchfuse.compat.gr.hstu_mha: only causal=True is implemented")
    return _hstu_attention(q, k, v, seq_offsets, max_seq_len, alpha, num_targets=num_targets,
                           contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len,
                           min_full_attn_seq_len=min_full_attn_seq_len, dropout_p=dropout_pr, training=training)


def delta_hstu_mha(
    max_seq_len: int,
    alpha: float,
    delta_q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    seq_offsets: _torch.Tensor,
    num_targets: _Optional[_torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    kernel=None,
    enable_tma: bool = False,
) -> _torch.Tensor:
    """generative-recommenders' ``delta_hstu_mha`` (cached inference: ``delta_q`` holds the last
    ``len(delta_q) // B`` query rows of every sequence), on :func:`torchfuse.hstu_attention_cached`.
    ``kernel`` and ``enable_tma`` are accepted and ignored."""
    return _hstu_attention_cached(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=num_targets,
                                  contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len)


# ---- the STU layer's input and output sections (ops/hstu_compute.py) ----


def hstu_compute_uqvk(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: Tensor,
    uvqk_bias: Tensor,
    kernel=None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """generative-recommenders' ``hstu_compute_uqvk``: :func:`torchfuse.hstu_preprocess` (``kernel``
    ignored). Returns (u, q, k, v)."""
    from ..hstu_preprocess import hstu_preprocess
    return hstu_preprocess(x, norm_weight, norm_bias, norm_eps, uvqk_weight, uvqk_bias, num_heads, attn_dim,
                           hidden_dim)


def hstu_preprocess_and_attention(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: Tensor,
    uvqk_bias: Tensor,
    max_seq_len: int,
    seq_offsets: Tensor,
    attn_alpha: float,
    causal: bool,
    num_targets: Optional[Tensor],
    max_attn_len: int,
    contextual_seq_len: int,
    recompute_uvqk_in_backward: bool,
    recompute_normed_x_in_backward: bool,
    sort_by_length: bool,
    prefill: bool = False,
    kernel=None,
    enable_tma: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """generative-recommenders' ``hstu_preprocess_and_attention``: :func:`torchfuse.hstu_preprocess`
    with its recompute choices, then :func:`torchfuse.hstu_attention` (metadata not re-checked on the
    GPU, as GR's kernels do not check it). Returns (u, attn (L, H * hidden_dim), k, v); k and v are
    returned whether or not ``prefill`` is set (GR's Triton path returns None for them). ``kernel``,
    ``sort_by_length`` and ``enable_tma`` are ignored; ``causal=False`` raises NotImplementedError."""
    from ..hstu_preprocess import hstu_preprocess
    if not causal:
        raise NotImplementedError("torchfuse.compat.gr.hstu_preprocess_and_attention: only causal=True is implemented")
    u, q, k, v = hstu_preprocess(x, norm_weight, norm_bias, norm_eps, uvqk_weight, uvqk_bias, num_heads, attn_dim,
                                 hidden_dim, recompute_normed_x=recompute_normed_x_in_backward,
                                 recompute_uvqk=recompute_uvqk_in_backward)
    attn = _hstu_attention(q, k, v, seq_offsets, max_seq_len, attn_alpha, num_targets=num_targets,
                           contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len, validate=False)
    return u, attn.reshape(-1, hidden_dim * num_heads), k, v


def hstu_compute_output(
    attn: Tensor,
    u: Tensor,
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    norm_eps: float,
    output_weight: Tensor,
    num_heads: int,
    linear_dim: int,
    dropout_ratio: float,
    training: bool,
    concat_u: Optional[bool] = None,
    concat_x: Optional[bool] = None,
    mul_u_activation_type: str = "none",
    group_norm: bool = False,
    recompute_y_in_backward: bool = False,
    kernel=None,
    *,
    concat_ux: Optional[bool] = None,
    **ignored,
) -> Tensor:
    """generative-recommenders' ``hstu_compute_output``: :func:`torchfuse.hstu_compute_output`.
    Earlier GR releases pass ``concat_ux`` (both concatenations at once, u multiplied as given) instead
    of ``concat_u`` / ``concat_x`` / ``mul_u_activation_type``; both forms are accepted. ``kernel`` and
    GR's kernel-only options (such as ``fp8_in_addmm_fwd``) are ignored."""
    import torchfuse
    if concat_ux is not None:
        if concat_u is not None or concat_x is not None:
            raise ValueError("torchfuse.compat.gr.hstu_compute_output: pass concat_ux or concat_u / concat_x, "
                             "not both")
        concat_u = concat_x = bool(concat_ux)
    fn = getattr(torchfuse, "hstu_compute_output", None)  # looked up per call: a build may lack it
    if fn is None:
        raise NotImplementedError("torchfuse.compat.gr.hstu_compute_output: this torchfuse build has no "
                                  "torchfuse.hstu_compute_output")
    return fn(attn, u, x, norm_weight, norm_bias, norm_eps, output_weight, num_heads=num_heads, linear_dim=linear_dim,
              dropout_ratio=dropout_ratio, training=training, concat_u=bool(concat_u), concat_x=bool(concat_x),
              mul_u_activation_type=mul_u_activation_type, group_norm=group_norm,
              recompute_y_in_backward=recompute_y_in_backward)


# ---- norms and the GEMM (ops/layer_norm.py, ops/mm.py) ----


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5, kernel=None) -> Tensor:
    """generative-recommenders' ``layer_norm`` (LayerNorm over the last dim, computed in fp32, returned
    in x's dtype): :func:`torchfuse.layer_norm`; ``kernel`` ignored."""
    from ..norm import layer_norm as _ln
    return _ln(x, weight, bias, eps=eps)


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float = 1e-5, kernel=None) -> Tensor:
    """generative-recommenders' ``triton_rms_norm`` (``y = x * rsqrt(mean(x^2) + eps) * weight`` in fp32,
    rounded once to x's dtype): :func:`torchfuse.rms_norm` with ``cast="gemma"``."""
    from ..norm import rms_norm as _rms
    return _rms(x, weight, eps=eps, cast="gemma")


def addmm(input: Tensor, mat1: Tensor, mat2: Tensor, kernel=None) -> Tensor:
    """generative-recommenders' ``addmm``: ``torch.addmm`` (cuBLAS with the bias in its epilogue)."""
    return _torch.addmm(input, mat1, mat2)


# ---- patch() / unpatch(): route an installed generative_recommenders to the forms above ----

import functools as _functools  # noqa: E402
import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402
import sys as _sys  # noqa: E402

from .._stats import count as _count  # noqa: E402

_GR = "generative_recommenders"
# GR module -> {attribute GR's code looks up: the torchfuse form}; attributes a GR release lacks are skipped
_ROUTES = {
    "ops.hstu_attention": {"hstu_mha": "hstu_mha", "delta_hstu_mha": "delta_hstu_mha"},
    "ops.hstu_compute": {"hstu_compute_uqvk": "hstu_compute_uqvk", "hstu_compute_output": "hstu_compute_output",
                         "hstu_preprocess_and_attention": "hstu_preprocess_and_attention"},
    "ops.layer_norm": {"layer_norm": "layer_norm", "rms_norm": "rms_norm", "triton_rms_norm": "rms_norm"},
    "ops.jagged_tensors": {name: name for name in (
        "concat_2D_jagged", "split_2D_jagged", "concat_2D_jagged_multirow", "split_2D_jagged_multirow",
        "jagged_dense_bmm_broadcast_add")},
    "ops.mm": {"addmm": "addmm"},
}
_patched = []  # (module, attribute, original, replacement)


def _routed(attr: str, fn):
    name = f"gr.{attr}"

    @_functools.wraps(fn)
    def call(*args, **kwargs):
        _count(name)
        kwargs.pop("kernel", None)
        kwargs.pop("enable_tma", None)
        return fn(*args, **kwargs)

    return call


def _gr_modules():
    """The generative_recommenders modules loaded now, after importing those that hold the entry points
    and every module of ``generative_recommenders.modules`` that imports (their ``from ... import``
    bindings are what a model calls)."""
    try:
        _importlib.import_module(_GR)
    except ImportError as e:
        raise ImportError("torchfuse.compat.gr.patch: generative_recommenders is not importable (install it or put "
                          "its checkout on PYTHONPATH)") from e
    for sub in _ROUTES:
        try:
            _importlib.import_module(f"{_GR}.{sub}")
        except ImportError as e:
            raise ImportError(f"torchfuse.compat.gr.patch: {_GR}.{sub} does not import: {e}") from e
    try:
        pkg = _importlib.import_module(f"{_GR}.modules")
        for info in _pkgutil.iter_modules(getattr(pkg, "__path__", [])):
            if info.name != "tests":
                try:
                    _importlib.import_module(f"{_GR}.modules.{info.name}")
                except Exception:  # noqa: BLE001  (a module needing what is absent here is not used here)
                    pass
    except ImportError:
        pass
    return [m for n, m in list(_sys.modules.items())
            if m is not None and (n == _GR or n.startswith(_GR + ".")) and ".tests" not in n]


def patch():
    """Route an installed generative-recommenders' op entry points to torchfuse: hstu_mha,
    delta_hstu_mha, hstu_compute_uqvk, hstu_preprocess_and_attention, hstu_compute_output, layer_norm,
    rms_norm (``triton_rms_norm``, which GR's RMSNorm calls), concat/split_2D_jagged and their multirow
    forms, jagged_dense_bmm_broadcast_add and addmm. Each is replaced in the module that defines it and
    in every loaded GR module that bound it with ``from ... import``, whatever ``kernel`` GR passes.
    Every routed call counts as ``gr.<name>`` in :func:`torchfuse.stats`. Returns the
    ``module.attribute`` names replaced; calling it again changes nothing. Raises ImportError when
    ``generative_recommenders`` is not importable."""
    if _patched:
        return sorted({f"{m.__name__}.{a}" for m, a, _, _ in _patched})
    modules = _gr_modules()
    for sub, attrs in _ROUTES.items():
        home = _sys.modules[f"{_GR}.{sub}"]
        for attr, form in attrs.items():
            original = getattr(home, attr, None)
            if original is None:
                continue
            new = _routed(attr, globals()[form])
            for mod in modules:
                if getattr(mod, attr, None) is original:
                    setattr(mod, attr, new)
                    _patched.append((mod, attr, original, new))
    return sorted({f"{m.__name__}.{a}" for m, a, _, _ in _patched})


def unpatch() -> None:
    """Restore every attribute :func:`patch` replaced, including in GR modules imported after it
    (those bound the routed forms)."""
    for mod, attr, original, new in reversed(_patched):
        if getattr(mod, attr, None) is new:
            setattr(mod, attr, original)
    routed = {id(new): original for _, _, original, new in _patched}
    for n, mod in list(_sys.modules.items()):
        if mod is not None and (n == _GR or n.startswith(_GR + ".")):
            for attr, val in list(vars(mod).items()):
                if id(val) in routed:
                    setattr(mod, attr, routed[id(val)])
    _patched.clear()
