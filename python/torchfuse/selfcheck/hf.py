"""HuggingFace patching on a tiny randomly initialised Llama (no download): logits and hidden states
of the patched model against HF's own forward, and torchfuse.stats() showing the fused ops ran."""
import copy
import dataclasses
import importlib.util

import torch

import torchfuse

from ._common import Check, bench_row, close, skipped

FAMILY = "hf"
VOCAB = 97


def _model(device, dtype, hidden=64, layers=2, inter=128, heads=4):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norm weights away from their initial ones, so a norm ignoring them shows
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.uniform_(0.5, 1.5)
    return model.to(device=device, dtype=dtype).eval()


def _unavailable():
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    try:
        torchfuse.hf._version()  # raises for a transformers older than the supported ones
    except Exception as e:
        return str(e)
    return None


def checks(ctx):
    why = _unavailable()
    if why:
        return [skipped("patch_hf (Llama)", why)]
    dev, dt = ctx.device, ctx.dtype
    model = _model(dev, dt)
    ref_model = copy.deepcopy(model).double()
    ids = torch.randint(3, VOCAB, (2, 11), device=dev)
    with torch.no_grad():
        ref = ref_model(ids, output_hidden_states=True)
        lp = model(ids, output_hidden_states=True)
    torchfuse.patch_hf(model)
    out = []
    try:
        want = torchfuse.hf.expected_calls(model)
        for grad in (False, True):
            path = "training path" if grad else "inference path"
            with torch.set_grad_enabled(grad), torchfuse.stats() as calls:
                got = model(ids, output_hidden_states=True)
            # every layer's output; the line shows the one nearest its tolerance
            layers = [close(f"patch_hf Llama hidden state {i} ({path})", got.hidden_states[i].detach(),
                            ref.hidden_states[i], lp.hidden_states[i], 2.0, dt)
                      for i in range(1, len(ref.hidden_states))]
            out.append(max(layers, key=lambda c: c.err / c.tol if c.tol else float("inf")))
            out.append(close(f"patch_hf Llama logits ({path})", got.logits.detach(), ref.logits, lp.logits, 2.0, dt))
            missing = sum(abs(calls.get(k, 0) - v) for k, v in want.items())
            out.append(Check(f"patch_hf fused op calls ({path})", "-", float(missing), 0.0,
                             note="" if not missing else f"ran {dict(calls)}, expected {want}"))
    finally:
        torchfuse.unpatch_hf(model)
    return out


def _liger(model):
    """`model` with Liger-Kernel's RMSNorm patched in (its norms only, the part torchfuse replaces),
    or None when Liger is not installed. Liger swaps the class in transformers' module too: put back."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.models.llama import modeling_llama
    except Exception:
        return None
    saved = modeling_llama.LlamaRMSNorm
    try:
        apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=False,
                                    rms_norm=True, swiglu=False, model=model)
    finally:
        modeling_llama.LlamaRMSNorm = saved
    return model


def bench(ctx):
    if _unavailable():
        return None
    dev = ctx.device
    if dev == "cuda":
        dt, (hidden, layers, inter, heads), (batch, seq) = torch.bfloat16, (1024, 4, 2816, 16), (8, 512)
    else:
        dt, (hidden, layers, inter, heads), (batch, seq) = torch.float32, (256, 2, 512, 4), (2, 64)
    base = _model(dev, dt, hidden, layers, inter, heads)
    patched = torchfuse.patch_hf(copy.deepcopy(base))
    liger = _liger(copy.deepcopy(base)) if dev == "cuda" else None
    ids = torch.randint(3, VOCAB, (batch, seq), device=dev)
    # compiling a whole model takes longer than --quick's budget
    heavy = dataclasses.replace(ctx, compile=ctx.compile and not ctx.quick)
    with torch.no_grad():
        row = bench_row(heavy, FAMILY, f"patched Llama forward ({layers} layers)", f"{batch}x{seq}x{hidden}", dt,
                        lambda: patched(ids), lambda: base(ids),
                        (lambda: liger(ids)) if liger is not None else None, "Liger")
    if ctx.compile and not heavy.compile:
        row.note = "torch.compile of the model left out in --quick" + (f"; {row.note}" if row.note else "")
    return row
