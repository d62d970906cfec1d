"""torchfuse.patch_hf against HuggingFace's own forwards, on tiny randomly initialised models built
from configs (no downloads): GPT-NeoX (parallel and sequential residual), Llama, Mistral, Qwen2, Qwen3,
GPT-2. Both patched paths run: inference (grad disabled; adds fused across layer boundaries) and
training (grad enabled; fusion inside the layer). CI runs this file against transformers 5.17 and 5.24
(the oldest and newest tested); releases newer than those are simulated by the version string."""
import copy
import importlib
import inspect
import sys
import types
import warnings

import pytest
import torch

import torchfuse

transformers = pytest.importorskip("transformers", reason="tests/test_hf.py needs transformers (CI installs it)")
from transformers import AutoModelForCausalLM  # noqa: E402

VOCAB = 97
TYPES = ["gpt_neox", "gpt_neox_seq", "llama", "mistral", "qwen2", "qwen3", "gpt2"]
EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
CUDA = torch.cuda.is_available()


def make_config(kind, layers=3):
    """Tiny config: 3 layers, non-power-of-two widths, dropout off, token ids inside the vocabulary."""
    tok = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind.startswith("gpt_neox"):
        return transformers.GPTNeoXConfig(hidden_size=72, intermediate_size=100, num_hidden_layers=layers,
                                          num_attention_heads=3, rotary_pct=0.25, layer_norm_eps=1e-5,
                                          use_parallel_residual=(kind == "gpt_neox"), **tok)
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=60, n_layer=layers, n_head=3, n_positions=64, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, **tok)
    common = dict(hidden_size=60, intermediate_size=100, num_hidden_layers=layers, num_attention_heads=3,
                  num_key_value_heads=1, rms_norm_eps=1e-6, **tok)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=7, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=20, **common)
    raise ValueError(kind)


def make_model(kind, device="cpu", dtype=torch.float32, layers=3):
    model = AutoModelForCausalLM.from_config(make_config(kind, layers)).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # norm weights and biases away from their 1 / 0 initialisation
        for m in model.modules():
            name = type(m).__name__
            if isinstance(m, torch.nn.LayerNorm) or name.endswith("RMSNorm"):
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.normal_(0.0, 0.2)
    return model


def base_and_layers(model):
    base = model.base_model
    layers = base.h if hasattr(base, "h") else base.layers
    return base, layers


def ids_for(device, batch=2, length=11):
    return torch.randint(3, VOCAB, (batch, length), device=device)


def dtypes_for(device):
    return [torch.float32, torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32]


def assert_kernels_ran(model, run):
    """The patched path ran: exactly the expected number of torchfuse op calls, no fewer (a layer or
    the carry across layers fell back) and no more."""
    with torchfuse.stats() as calls:
        out = run()
    want = torchfuse.hf.expected_calls(model)
    assert want["norm_fwd"] > 0, "the model is not patched"
    assert calls == want, f"torchfuse calls {calls}, expected {want}"
    return out


class Fixed(torch.nn.Module):
    """Stand-in for attention or MLP: the same fixed tensor whatever the input."""

    def __init__(self, out, as_tuple):
        super().__init__()
        self.out, self.as_tuple = out, as_tuple

    def forward(self, *args, **kwargs):
        return (self.out, None) if self.as_tuple else self.out


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_order_isolated(kind, dtype, device):
    """With attention and MLP replaced by fixed tensors, a patched layer's output is bit-identical to HF's."""
    model = make_model(kind, device, dtype)
    _, layers = base_and_layers(model)
    layer = layers[1]
    shape = (2, 9, model.config.hidden_size)
    h = (torch.randn(shape, device=device) * 8).to(dtype)
    attn_out = torch.randn(shape, device=device).to(dtype)
    mlp_out = (torch.randn(shape, device=device) * 3).to(dtype)
    attn_name = {"gpt2": "attn"}.get(kind, "attention" if kind.startswith("gpt_neox") else "self_attn")
    setattr(layer, attn_name, Fixed(attn_out, True))
    layer.mlp = Fixed(mlp_out, False)
    with torch.no_grad():
        ref = layer(h)
    if kind == "gpt_neox" and dtype != torch.float32:  # the test can tell the orders apart
        assert not torch.equal(mlp_out + (attn_out + h), ref)
    torchfuse.patch_hf(model)
    with torch.no_grad():
        got_infer = layer(h)
    got_train = layer(h.clone().requires_grad_())
    assert torch.equal(got_infer, ref)
    assert torch.equal(got_train.detach(), ref)
    torchfuse.unpatch_hf(model)
    with torch.no_grad():
        assert torch.equal(layer(h), ref)


def close_per_layer(got, ref, dtype, what):
    """Within a few ulps per layer: |got - ref| <= 4 (i+1) ulp(max |ref_i|) for layer i."""
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        tol = 4 * (i + 1) * EPS[dtype] * r.float().abs().max().item()
        err = (g.float() - r.float()).abs().max().item()
        assert err <= tol, f"{what}[{i}]: max error {err:.3g} > {tol:.3g}"


def close_logits(got, ref, dtype, n_layers, what):
    """Logits come after every layer, the final norm and the head: 4 (layers + 2) ulps of max |logit|."""
    tol = 4 * (n_layers + 2) * EPS[dtype] * ref.float().abs().max().item()
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("kind", TYPES)
def test_whole_model(kind, device):
    """Hidden states layer by layer and logits within a few ulps per layer, both patched paths; the
    counts show the fused path ran (carry across layers included)."""
    for dtype in dtypes_for(device):
        model = make_model(kind, device, dtype)
        ids = ids_for(device)
        with torch.no_grad():
            ref = model(ids, output_hidden_states=True)
        torchfuse.patch_hf(model)
        n_layers = model.config.num_hidden_layers
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                out = assert_kernels_ran(model, lambda: model(ids, output_hidden_states=True))
            assert len(out.hidden_states) == n_layers + 1
            close_per_layer(out.hidden_states, ref.hidden_states, dtype, f"{kind} {dtype} grad={grad} hidden")
            close_logits(out.logits, ref.logits, dtype, n_layers, f"{kind} {dtype} grad={grad} logits")


@pytest.mark.parametrize("kind", TYPES)
def test_generate_greedy(kind, device):
    """Greedy generate of 20 tokens: the same tokens up to a near tie of the top-2 logits."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = make_model(kind, device, dtype)
    ids = ids_for(device, batch=1, length=5)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    torchfuse.patch_hf(model)
    with torchfuse.stats() as calls:
        got = model.generate(ids, **kw)
    assert calls == {k: 20 * v for k, v in torchfuse.hf.expected_calls(model).items()}
    ref_tok, got_tok = ref.sequences[0, 5:], got.sequences[0, 5:]
    for t in range(20):
        if ref_tok[t] != got_tok[t]:
            top2 = ref.logits[t][0].float().topk(2).values
            margin = (top2[0] - top2[1]).item()
            near_tie = 16 * EPS[dtype] * top2[0].abs().item() + 1e-6
            assert margin <= near_tie, f"token {t} differs with a top-2 margin of {margin:.3g}"
            break


@pytest.mark.parametrize("kind", TYPES)
def test_kernels_not_reached_fail(kind, device):
    """The count check catches a patch that silently runs HF code: one layer reverted to its class forward."""
    model = make_model(kind, device)
    ids = ids_for(device)
    torchfuse.patch_hf(model)
    assert_kernels_ran(model, lambda: model(ids))
    base, layers = base_and_layers(model)
    final = base.ln_f if kind == "gpt2" else base.final_layer_norm if kind.startswith("gpt_neox") else base.norm
    for reverted in (layers[1], final):  # simulate a fallback to HF's code in one layer, or the final norm
        forward = reverted.forward
        del reverted.forward
        for grad in (False, True):
            with torch.set_grad_enabled(grad), pytest.raises(AssertionError, match="torchfuse calls"):
                assert_kernels_ran(model, lambda: model(ids))
        reverted.forward = forward
    assert_kernels_ran(model, lambda: model(ids))


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_step(kind, checkpointing, device):
    """One training step: loss and every gradient match HF's within fp32 tolerance."""
    model = make_model(kind, device, torch.float32).train()
    if checkpointing:
        # renamed in 5.24 (the old name warns there)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ids = ids_for(device)
    ref_loss = model(ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torchfuse.patch_hf(model)
    loss = assert_kernels_ran(model, lambda: model(ids, labels=ids, use_cache=False).loss)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        scale = ref_grads[n].abs().max().item()
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-5 * max(scale, 1e-3), msg=n)


@pytest.mark.parametrize("kind", TYPES)
def test_unpatch_restores_bit_for_bit(kind, device):
    model = make_model(kind, device)
    ids = ids_for(device)
    with torch.no_grad():
        ref = model(ids).logits
        torchfuse.patch_hf(model)
        torchfuse.patch_hf(model)  # patching twice is patching once
        assert torchfuse.hf.is_patched(model)
        assert_kernels_ran(model, lambda: model(ids))
        torchfuse.unpatch_hf(model)
        assert not torchfuse.hf.is_patched(model)
        with torchfuse.stats() as calls:
            out = model(ids).logits
    assert calls == {}
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kind", ["llama", "gpt_neox", "gpt2"])
def test_class_patch_builds_patched_models(kind, device):
    model_type = make_config(kind).model_type
    torchfuse.patch_hf(model_type=model_type)
    try:
        model = make_model(kind, device)
        assert torchfuse.hf.is_patched(model)
        assert_kernels_ran(model, lambda: model(ids_for(device)))
    finally:
        torchfuse.unpatch_hf(model_type=model_type)
    assert not torchfuse.hf.is_patched(make_model(kind, device))


def test_modified_hidden_state_is_not_served_from_carry(device):
    """A forward hook that changes a layer's output in place: the next layer normalizes the changed
    tensor (the carried norm of the old values is dropped), as HF would."""
    model = make_model("llama", device)
    ids = ids_for(device)
    _, layers = base_and_layers(model)
    layers[0].register_forward_hook(lambda mod, args, out: out.mul_(1.5))
    with torch.no_grad():
        ref = model(ids).logits
        torchfuse.patch_hf(model)
        with torchfuse.stats() as calls:
            got = model(ids).logits
    want = torchfuse.hf.expected_calls(model)
    assert calls == dict(want, norm_fwd=want["norm_fwd"] + 1)  # one carry miss
    close_logits(got, ref, torch.float32, model.config.num_hidden_layers, "logits")


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_deepcopy_of_patched_model(kind):
    """A deep copy of a patched model refuses to run until patched itself (its forwards would run the
    original's submodules), then matches the original."""
    model = make_model(kind)
    ids = ids_for("cpu")
    torchfuse.patch_hf(model)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(ids).logits
        with pytest.raises(RuntimeError, match="copy"):
            copied(ids)
        torchfuse.patch_hf(copied)
        got = assert_kernels_ran(copied, lambda: copied(ids).logits)
    assert torch.equal(got, ref)


def test_gpt2_cross_attention(device):
    cfg = make_config("gpt2")
    cfg.add_cross_attention = True
    model = AutoModelForCausalLM.from_config(cfg).to(device).eval()
    ids = ids_for(device)
    enc = torch.randn(2, 5, cfg.n_embd, device=device)
    with torch.no_grad():
        ref = model(ids, encoder_hidden_states=enc).logits
        torchfuse.patch_hf(model)
        with torchfuse.stats() as calls:
            got = model(ids, encoder_hidden_states=enc).logits
    assert calls == torchfuse.hf.expected_calls(model, cross_attention=True)
    close_logits(got, ref, torch.float32, model.config.num_hidden_layers, "logits")


def test_errors():
    bert = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=40)
    model = transformers.BertModel(bert)
    with pytest.raises(ValueError, match="supported: llama, mistral, qwen2, qwen3, gpt_neox, gpt2"):
        torchfuse.patch_hf(model)
    with pytest.raises(ValueError, match="not supported"):
        torchfuse.patch_hf(model_type="bert")
    llama = make_model("llama")
    custom = copy.deepcopy(llama)
    custom.model.layers[0].input_layernorm = torch.nn.LayerNorm(60)
    with pytest.raises(TypeError, match="input_layernorm"):
        torchfuse.patch_hf(custom)


def test_transformers_version_range(monkeypatch):
    """Releases older than 5.17 are refused; a newer one whose layer forwards keep the tested forms is
    patched in full, without a warning."""
    model = make_model("llama")
    for version in ("4.57.1", "5.16.0", "5"):
        monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
        with pytest.raises(RuntimeError, match=f"supports transformers >=5.17 .*found transformers {version}"):
            torchfuse.patch_hf(model)
    assert not torchfuse.hf.is_patched(model)
    for version in ("5.17.0", "5.24.0", "5.99.0", "6.0.0rc1"):
        monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torchfuse.patch_hf(model, strict=True)
        assert_kernels_ran(model, lambda: model(ids_for("cpu")))
        torchfuse.unpatch_hf(model)


def _hf_signature(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("kind", TYPES)
def test_newer_release_with_the_tested_forms(kind, monkeypatch):
    """A release newer than any tested whose layer and norm forwards keep the tested forms: patched in
    full, no warning, the residual stream bit-identical to HF's, and the patched layer takes HF's own
    arguments (past_key_values through 5.23, cache from 5.24)."""
    model = make_model(kind)
    _, layers = base_and_layers(model)
    hf_sig = _hf_signature(layers[0].forward)
    ids = ids_for("cpu")
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchfuse.patch_hf(model)
    assert _hf_signature(layers[0].forward) == hf_sig
    with torch.no_grad():
        out = assert_kernels_ran(model, lambda: model(ids, output_hidden_states=True))
    close_per_layer(out.hidden_states, ref.hidden_states, torch.float32, kind)


def _changed(fn):
    def forward(self, *args, **kwargs):  # another form than the one torchfuse mirrors, same results
        return fn(self, *args, **kwargs)
    return forward


@pytest.mark.parametrize("kind", ["llama", "gpt_neox", "gpt2"])
def test_newer_release_with_a_changed_layer(kind, monkeypatch):
    """A newer release whose decoder layer forward changed: its norms run on torchfuse's kernels, its
    adds stay HF's; one warning naming the version and what was left unfused; strict=True raises."""
    model = make_model(kind)
    _, layers = base_and_layers(model)
    layer_cls = type(layers[0])
    ids = ids_for("cpu")
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.98.0")
    monkeypatch.setattr(layer_cls, "forward", _changed(layer_cls.forward))
    with pytest.raises(RuntimeError, match=f"transformers 5.98.0 .*{layer_cls.__name__}.forward.*strict=True"):
        torchfuse.patch_hf(model, strict=True)
    assert not torchfuse.hf.is_patched(model)
    with pytest.warns(RuntimeWarning, match=f"transformers 5.98.0 .*{layer_cls.__name__}.forward differs.*"
                                            "residual adds stay HF's"):
        torchfuse.patch_hf(model)
    with warnings.catch_warnings():  # once per version and model type
        warnings.simplefilter("error")
        torchfuse.patch_hf(make_model(kind))
    assert torchfuse.hf.expected_calls(model) == {"norm_fwd": 2 * model.config.num_hidden_layers + 1}
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out = assert_kernels_ran(model, lambda: model(ids, output_hidden_states=True))
        close_per_layer(out.hidden_states, ref.hidden_states, torch.float32, f"{kind} grad={grad}")
    torchfuse.unpatch_hf(model)
    with torch.no_grad(), torchfuse.stats() as calls:
        assert torch.equal(model(ids).logits, ref.logits)
    assert calls == {}


def test_newer_release_with_a_changed_norm(monkeypatch):
    """A newer release whose RMSNorm forward changed: nothing can be verified, nothing is patched."""
    model = make_model("llama")
    norm_cls = type(model.model.norm)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.97.0")
    monkeypatch.setattr(norm_cls, "forward", _changed(norm_cls.forward))
    with pytest.raises(RuntimeError, match="transformers 5.97.0 .*LlamaRMSNorm.forward differs"):
        torchfuse.patch_hf(model, strict=True)
    with pytest.warns(RuntimeWarning, match="LlamaRMSNorm.forward differs.*nothing was patched"):
        torchfuse.patch_hf(model)
    assert not torchfuse.hf.is_patched(model)


# ---------------------------------------------------------------- composing with Liger-Kernel

LIGER_TYPES = ["llama", "mistral", "qwen2", "qwen3"]  # the families Liger-Kernel patches among ours


@pytest.fixture
def liger():
    """liger_kernel.transformers, with everything its apply_liger_kernel_to_* functions replace in the
    transformers modules (classes, functions, head forwards) put back after the test."""
    lk = pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed")
    saved = []
    for kind in LIGER_TYPES:
        mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        saved.append((mod, dict(vars(mod))))
        head = getattr(mod, {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
                       + "ForCausalLM")
        saved.append((head, {"forward": head.__dict__["forward"]}))
    yield lk
    for obj, attrs in saved:
        for k, v in attrs.items():
            setattr(obj, k, v)


def _liger_rms():
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    return LigerRMSNorm.forward


def _runs_liger_norm(module):
    own = module.__dict__.get("forward")
    return (own.__func__ if own is not None else type(module).forward) is _liger_rms()


def _plain_rms_forward(self, x):
    """HF's Llama RMSNorm in PyTorch: a CPU stand-in for Liger's Triton RMSNorm inside Qwen3's attention
    (q_norm / k_norm), which patch_hf does not take over."""
    v = x.float().pow(2).mean(-1, keepdim=True)
    return self.weight * (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)


def _apply_liger(lk, kind, model, rms_norm, all_kernels):
    """apply_liger_kernel_to_<kind>: on the CPU with its norm replacement only (Liger's other kernels
    are Triton and need the GPU), on the GPU with RoPE, SwiGLU and fused linear cross-entropy too."""
    getattr(lk, f"apply_liger_kernel_to_{kind}")(
        rope=all_kernels, cross_entropy=False, fused_linear_cross_entropy=all_kernels, rms_norm=rms_norm,
        swiglu=all_kernels, model=model)


def _qk_norm_stand_ins(model):
    for m in model.modules():
        if m.__class__.__name__.endswith("Attention"):
            for name in ("q_norm", "k_norm"):
                if hasattr(m, name) and _runs_liger_norm(getattr(m, name)):
                    getattr(m, name).forward = types.MethodType(_plain_rms_forward, getattr(m, name))


def assert_residual_adds_exact(model, run):
    """Every decoder layer's output is HF's residual sums of the tensors it saw, bit for bit:
    (input + attention output) + MLP output, recorded by hooks on the layer, its attention and its MLP."""
    _, layers = base_and_layers(model)
    seen, handles = [], []
    for layer in layers:
        d = {}
        handles += [
            layer.register_forward_pre_hook(lambda m, args, kw, d=d: d.__setitem__(
                "x", args[0] if args else kw["hidden_states"]), with_kwargs=True),
            layer.self_attn.register_forward_hook(lambda m, args, out, d=d: d.__setitem__("a", out[0])),
            layer.mlp.register_forward_hook(lambda m, args, out, d=d: d.__setitem__("m", out)),
            layer.register_forward_hook(lambda m, args, out, d=d: seen.append((d["x"], d["a"], d["m"], out))),
        ]
    try:
        result = run()
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == len(layers)
    for i, (x, a, m, out) in enumerate(seen):
        assert torch.equal(out, (x + a) + m), f"layer {i}: the residual stream differs from HF's sums"
    return result


@pytest.mark.parametrize("kind", LIGER_TYPES)
@pytest.mark.parametrize("rms_norm", [True, False])
@pytest.mark.parametrize("when", ["instance", "class"])
def test_liger_then_patch_hf_cpu(liger, kind, rms_norm, when):
    """patch_hf after apply_liger_kernel_to_<kind> (Liger's norm replacement on an existing model, or on
    the classes before the model is built): patch_hf takes over Liger's norm modules and the residual
    adds; the fused path is what runs (counts; Liger's Triton RMSNorm cannot run on the CPU, so a run
    that reached it would fail), the residual adds are HF's bit for bit, hidden states and logits as
    close to HF's as without Liger; unpatch_hf gives Liger's norms back."""
    hf = make_model(kind)
    ids = ids_for("cpu")
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    if when == "instance":
        model = copy.deepcopy(hf)
        _apply_liger(liger, kind, model, rms_norm, all_kernels=False)
    else:
        _apply_liger(liger, kind, None, rms_norm, all_kernels=False)
        model = AutoModelForCausalLM.from_config(make_config(kind)).eval()
        model.load_state_dict(hf.state_dict())
    base, layers = base_and_layers(model)
    norms = [base.norm, *(n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
    assert all(_runs_liger_norm(n) == rms_norm for n in norms)
    _qk_norm_stand_ins(model)
    torchfuse.patch_hf(model)
    n_layers = model.config.num_hidden_layers
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out = assert_kernels_ran(model, lambda: assert_residual_adds_exact(
                model, lambda: model(ids, output_hidden_states=True)))
        close_per_layer(out.hidden_states, ref.hidden_states, torch.float32, f"{kind} grad={grad} hidden")
        close_logits(out.logits, ref.logits, torch.float32, n_layers, f"{kind} grad={grad} logits")
    torchfuse.unpatch_hf(model)
    assert all(_runs_liger_norm(n) == rms_norm for n in norms)
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_liger_norm_of_another_form_is_refused(liger):
    """A Liger RMSNorm in Gemma's form (offset 1, casting_mode 'gemma') computes something else: refused."""
    model = make_model("llama")
    _apply_liger(liger, "llama", model, True, all_kernels=False)
    model.model.layers[1].post_attention_layernorm.offset = 1.0
    with pytest.raises(ValueError, match=r"layers\[1\].post_attention_layernorm is Liger's RMSNorm with offset=1.0"):
        torchfuse.patch_hf(model)
    assert not torchfuse.hf.is_patched(model)


@pytest.mark.skipif(not CUDA, reason="CUDA only")
@pytest.mark.parametrize("kind", LIGER_TYPES)
@pytest.mark.parametrize("rms_norm", [True, False])
@pytest.mark.parametrize("when", ["instance", "class"])
def test_liger_then_patch_hf_cuda(liger, kind, rms_norm, when):
    """On the GPU with Liger's kernels (RoPE, SwiGLU, fused linear cross-entropy, and its RMSNorm or
    HF's): the residual adds are HF's bit for bit (bf16), logits close to Liger alone and to HF, and a
    training step's loss and gradients (fp32) match Liger alone's."""
    hf = make_model(kind, "cuda", torch.bfloat16)
    ids = ids_for("cuda")
    with torch.no_grad():  # before Liger replaces functions in the modeling module (RoPE) that hf uses too
        ref_hf = hf(ids).logits

    def liger_model(dtype):
        if when == "instance":
            m = copy.deepcopy(hf).to(dtype)
            _apply_liger(liger, kind, m, rms_norm, all_kernels=True)
            return m
        _apply_liger(liger, kind, None, rms_norm, all_kernels=True)
        m = AutoModelForCausalLM.from_config(make_config(kind)).to("cuda", dtype).eval()
        m.load_state_dict(hf.state_dict())
        return m

    alone, both = liger_model(torch.bfloat16), liger_model(torch.bfloat16)
    torchfuse.patch_hf(both)
    n_layers = hf.config.num_hidden_layers
    with torch.no_grad():
        ref = alone(ids).logits
        got = assert_kernels_ran(both, lambda: assert_residual_adds_exact(both, lambda: both(ids).logits))
    close_logits(got, ref, torch.bfloat16, n_layers, f"{kind} logits vs Liger alone")
    close_logits(got, ref_hf, torch.bfloat16, n_layers + 2, f"{kind} logits vs HF")
    # a training step in fp32 (Liger's fused linear cross-entropy computes the loss)
    alone, both = liger_model(torch.float32).train(), liger_model(torch.float32).train()
    torchfuse.patch_hf(both)
    ref_loss = alone(ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    loss = assert_kernels_ran(both, lambda: assert_residual_adds_exact(
        both, lambda: both(ids, labels=ids, use_cache=False).loss))
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_grads = {n: p.grad for n, p in alone.named_parameters() if p.grad is not None}
    grads = {n: p.grad for n, p in both.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        scale = ref_grads[n].abs().max().item()
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-5 * max(scale, 1e-3), msg=n)
