"""HuggingFace models patched with torchfuse.patch_hf against the same models unpatched, in one run.

Models (random weights, built on the GPU from configs): a Pythia-2.8B-shaped GPT-NeoX (32 layers,
hidden 2560, parallel residual, fp16) and a Llama-3.2-1B-shaped Llama (16 layers, hidden 2048, GQA
32/8, bf16). For each:

* prefill: one forward of batch 8 x 512 tokens (``logits_to_keep=1``, as generate's prefill), tokens/s;
* decode: batch 1, a 16-token prompt, then 128 greedy steps with the KV cache (``DynamicCache``),
  wall time per output token (host dispatch included: at one token that is what decides);
* kernel launches inside one decoder layer (a middle one), counted with torch.profiler from the
  launch calls made between that layer's forward pre-hook and forward hook, decode and prefill.

With Liger-Kernel importable (pip, or ``--peers DIR``: a folder holding the liger_kernel package), the
Llama is also run as Liger patches it (``apply_liger_kernel_to_llama``: RoPE, SwiGLU MLP, RMSNorm,
fused linear + cross-entropy loss) against the same model with ``patch_hf`` on top (torchfuse's fused
add + RMSNorm in place of Liger's RMSNorm, Liger's other kernels kept): prefill as above, and a
training step (forward with the loss over every position, and backward; no optimizer step).

Patched and unpatched alternate in rounds (A B A B ...); the median round of each is reported: whole
model calls are timed by the host clock around a synchronized call (the host's dispatch is the decode
step's cost). The norm + residual-add section of one layer is timed as every kernel benchmark is
(benchmarks/_common.py).

    python benchmarks/bench_hf.py [--quick] [--tiny] [--peers DIR] [--out results.md]
"""
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import torchfuse

import _common as C

MODELS = {
    "Pythia-2.8B-shaped GPT-NeoX": (lambda: transformers.GPTNeoXConfig(
        vocab_size=50304, hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, intermediate_size=10240,
        rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048, layer_norm_eps=1e-5,
        use_parallel_residual=True, tie_word_embeddings=False), torch.float16),
    "Llama-1B-shaped Llama": (lambda: transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, rope_theta=500000.0, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=True), torch.bfloat16),
}
TINY = {"layers": 2, "hidden": 64}


def build(make_config, dtype, device, tiny):
    cfg = make_config()
    if tiny:  # a CPU smoke run of this script
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = TINY["layers"], TINY["hidden"], 96
        cfg.num_attention_heads = 4
        if hasattr(cfg, "num_key_value_heads"):
            cfg.num_key_value_heads = 2
        cfg.vocab_size = 1000
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def prefill(model, ids):
    return model(ids, use_cache=False, logits_to_keep=1).logits


def decode(model, prompt, steps):
    cache = DynamicCache(config=model.config)
    out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    toks = [tok]
    for _ in range(steps):
        out = model(tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(tok)
    return torch.cat(toks, 1)


def decode_margins(model, prompt, steps):
    """HF's own greedy decode: (top-1, top-2) logit of every step, to judge where tokens diverge."""
    cache = DynamicCache(config=model.config)
    out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tops = []
    for i in range(steps + 1):
        top = out.logits[0, -1].float().topk(2).values
        tops.append(top)
        if i < steps:
            out = model(out.logits[:, -1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
    return torch.stack(tops).tolist()


def norm_section(model, device, dtype, rows):
    """Per layer, HF's norm + residual-add code against the patched layer's ops, decode and prefill sizes."""
    from torchfuse.hf import _layers

    base = model.base_model
    layer = (base.h if hasattr(base, "h") else base.layers)[1]
    n = model.config.hidden_size
    out = []
    for what, hf, tf in _sections(layer, n, dtype, device, _layers):
        dec = C.wall_us([hf(1), tf(1)], calls=200, rounds=5) if device == "cuda" else [0.0, 0.0]
        pre = [C.bench_us(f(rows)) for f in (hf, tf)] if device == "cuda" else [0.0, 0.0]
        out.append((what, dec[0], dec[1], pre[0], pre[1]))
    return out


def _sections(layer, n, dtype, device, ops):
    def t(rows):
        return torch.randn(rows, n, device=device, dtype=dtype)

    if hasattr(layer, "use_parallel_residual"):  # GPT-NeoX parallel: 3-way add, two norms of the sum
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm

        def hf(rows):
            m, a, h = t(rows), t(rows), t(rows)
            return lambda: (lambda s: (ln1(s), ln2(s)))(m + a + h)

        def tf(rows):
            m, a, h = t(rows), t(rows), t(rows)

            def f():
                with ops._below_autograd():
                    return ops._fwd(m, a, h, ln1.weight, ln1.bias, ln2.weight, ln2.bias, ln1.eps, 0, 0.0, None, False)
            return f
        return [("(mlp + attn) + h, 2 LayerNorms", hf, tf)]
    ln = layer.post_attention_layernorm  # Llama: the same pair twice per layer

    def hf(rows):
        x, h = t(rows), t(rows)
        return lambda: ln(h + x)

    def tf(rows):
        x, h = t(rows), t(rows)
        return lambda: ops._infer(x, h, ln.weight, None, ln.variance_epsilon, 1, 0.0)
    return [("h + x, RMSNorm (twice per layer)", hf, tf)]


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def launches_in_layer(model, fn, device):
    """Kernel launch calls made while one middle decoder layer runs (its forward, hooks excluded)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    base = model.base_model
    layers = base.h if hasattr(base, "h") else base.layers
    layer = layers[len(layers) // 2]
    state = {}

    def pre(mod, args):
        state["rf"] = record_function("tf_bench_layer")
        state["rf"].__enter__()

    def post(mod, args, out):
        state["rf"].__exit__(None, None, None)

    h1, h2 = layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)
    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            fn()
            sync(device)
    finally:
        h1.remove()
        h2.remove()
    events = prof.events()
    # record_function also leaves a GPU-timeline annotation of that name: the host-side window only
    cpu = torch.autograd.DeviceType.CPU
    windows = [(e.time_range.start, e.time_range.end) for e in events
               if e.name == "tf_bench_layer" and e.device_type == cpu]
    if device != "cuda":  # no launches on the CPU: count aten ops instead (smoke runs)
        return sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is not None
                   and e.cpu_parent.name == "tf_bench_layer")
    n = sum(1 for e in events if "LaunchKernel" in e.name and e.device_type == cpu
            and any(a <= e.time_range.start <= b for a, b in windows))
    return n / max(len(windows), 1)


def run_model(name, make_config, dtype, device, args):
    model = build(make_config, dtype, device, args.tiny)
    L = model.config.num_hidden_layers
    batch, length = (2, 16) if args.tiny else (8, 512)
    steps = 8 if args.tiny else 128
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), device=device)
    rounds = 2 if (args.quick or args.tiny) else 5
    res = {"pre": {False: [], True: []}, "dec": {False: [], True: []}, "tok": {}}
    with torch.no_grad():
        for patched in (False, True):  # warm up both (allocator, cuBLAS heuristics, SDPA)
            if patched:
                torchfuse.patch_hf(model)
            prefill(model, ids)
            decode(model, prompt, steps)
            torchfuse.unpatch_hf(model)
        for _ in range(rounds):
            for patched in (False, True):
                if patched:
                    torchfuse.patch_hf(model)
                t, _ = timed(lambda: prefill(model, ids), device)
                res["pre"][patched].append(batch * length / t)
                t, toks = timed(lambda: decode(model, prompt, steps), device)
                res["dec"][patched].append(t / (steps + 1) * 1e3)
                res["tok"][patched] = toks
                torchfuse.unpatch_hf(model)
        launches = {}
        for patched in (False, True):
            if patched:
                torchfuse.patch_hf(model)
            cache = DynamicCache(config=model.config)
            model(prompt, past_key_values=cache, use_cache=True)
            tok = prompt[:, -1:]
            launches[("dec", patched)] = launches_in_layer(
                model, lambda: model(tok, past_key_values=cache, use_cache=True), device)
            launches[("pre", patched)] = launches_in_layer(model, lambda: prefill(model, ids), device)
            if patched:
                with torchfuse.stats() as calls:
                    model(tok, past_key_values=cache, use_cache=True)
                assert calls == torchfuse.hf.expected_calls(model), (calls, torchfuse.hf.expected_calls(model))
                torchfuse.unpatch_hf(model)
        margins = decode_margins(model, prompt, steps)
        section = norm_section(model, device, dtype, batch * length)
    diff = (res["tok"][False] != res["tok"][True])[0].nonzero()
    first = int(diff[0]) if len(diff) else None
    if first is None:
        agree = f"all {steps + 1}"
    else:  # greedy tokens agree up to a step whose HF top-2 margin is this many ulps of the top logit
        top1, top2 = margins[first]
        ulps = (top1 - top2) / (torch.finfo(dtype).eps * max(abs(top1), 1e-30))
        agree = f"{first} of {steps + 1}; then a top-2 margin of {ulps:.1f} ulp"
    med = {k: {p: statistics.median(v[p]) for p in (False, True)} for k, v in res.items() if k != "tok"}
    best = {p: min(res["dec"][p]) for p in (False, True)}
    model = None  # freed before the next model
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(name=name, dtype=str(dtype).replace("torch.", ""), layers=L, batch=batch, length=length,
                steps=steps, pre=med["pre"], dec=med["dec"], launches=launches, agree=agree, section=section, best=best,
                raw={k: v for k, v in res.items() if k != "tok"})


LIGER_MODEL = "Llama-1B-shaped Llama"


def liger_apply(path):
    """Liger-Kernel's apply_liger_kernel_to_llama (from `path` first when given), or None."""
    m = C.import_peer("liger_kernel.transformers", path)
    return getattr(m, "apply_liger_kernel_to_llama", None)


def train_step(model, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


def run_liger(apply, device, args):
    """The Llama as Liger-Kernel patches it, against the same model with patch_hf on top: prefill tokens/s
    and training-step time, interleaved rounds; the first step's loss of each (same weights, same ids)."""
    from transformers.models.llama import modeling_llama
    saved = {k: getattr(modeling_llama, k) for k in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    make_config, dtype = MODELS[LIGER_MODEL]
    model = build(make_config, dtype, device, args.tiny)
    batch, length = (2, 16) if args.tiny else (8, 512)
    steps = 2 if args.tiny else 5
    rounds = 2 if (args.quick or args.tiny) else 3
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    res = {"pre": {False: [], True: []}, "train": {False: [], True: []}, "loss": {}}
    try:  # Liger swaps transformers' classes and RoPE function too: put back afterwards
        apply(rope=True, swiglu=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=True,
              model=model)
        for timing in (False, True):  # the first pass warms both up
            for _ in range(rounds if timing else 1):
                for patched in (False, True):
                    if patched:
                        torchfuse.patch_hf(model)
                    with torch.no_grad():
                        model.eval()
                        t, _ = timed(lambda: prefill(model, ids), device)
                    model.train()
                    u, loss = timed(lambda: [train_step(model, ids) for _ in range(steps)], device)
                    if timing:
                        res["pre"][patched].append(batch * length / t)
                        res["train"][patched].append(u / steps * 1e3)
                    else:
                        res["loss"][patched] = float(loss[0])
                    torchfuse.unpatch_hf(model)
        torchfuse.patch_hf(model)
        with torchfuse.stats() as calls:  # the patched layers ran in the training forward, Liger's loss kept
            model(ids, labels=ids)
        want = torchfuse.hf.expected_calls(model)
        assert all(calls.get(k, 0) == v for k, v in want.items()), (dict(calls), want)
        torchfuse.unpatch_hf(model)
    finally:
        for k, v in saved.items():
            setattr(modeling_llama, k, v)
    model = None
    if device == "cuda":
        torch.cuda.empty_cache()
    med = {k: {p: statistics.median(res[k][p]) for p in (False, True)} for k in ("pre", "train")}
    return dict(name=LIGER_MODEL, batch=batch, length=length, steps=steps, loss=res["loss"], **med)


def run(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rep = C.Report("hf", "HuggingFace decoders patched with torchfuse.patch_hf")
    rep.roofline = "- (end-to-end model calls: attention and MLP GEMMs dominate; the norm sections are memory-bound)"
    rep.peers = [f"the same model unpatched (HF eager, transformers {transformers.__version__})"]
    rep.notes = ["prefill batch x tokens, decode batch 1 with the KV cache (wall time per token); median of "
                 "interleaved rounds, and for decode the best round too: decode at batch 1 is bound by the host's "
                 "dispatch, so any load on the host moves it: the best round is the least disturbed one"]
    rows = []
    for name, (make_config, dtype) in MODELS.items():
        if args.only and args.only not in name:
            continue
        rows.append(run_model(name, make_config, dtype, device, args))
        print(f"done: {name}", file=sys.stderr, flush=True)
    rep.table("Whole models (random weights).",
              ["model", "dtype", "prefill tok/s HF", "patched", "speedup", "decode ms/token HF (best)", "patched (best)",
               "speedup (of the best)", "launches/layer decode HF -> patched", "prefill HF -> patched",
               "greedy tokens equal for"],
              [[f"{r['name']} ({r['layers']} layers, prefill {r['batch']}x{r['length']}, decode {r['steps']})",
                r["dtype"], f"{r['pre'][False]:,.0f}", f"{r['pre'][True]:,.0f}",
                f"{r['pre'][True] / r['pre'][False]:.3f}x", f"{r['dec'][False]:.2f} ({r['best'][False]:.2f})",
                f"{r['dec'][True]:.2f} ({r['best'][True]:.2f})",
                f"{r['dec'][False] / r['dec'][True]:.3f}x ({r['best'][False] / r['best'][True]:.3f}x)",
                f"{r['launches'][('dec', False)]:g} -> {r['launches'][('dec', True)]:g}",
                f"{r['launches'][('pre', False)]:g} -> {r['launches'][('pre', True)]:g}", r["agree"]]
               for r in rows])
    liger = None
    if not args.only or args.only in LIGER_MODEL:
        apply = liger_apply(args.peers)
        if apply is not None:
            liger = run_liger(apply, device, args)
            rep.peers.append("Liger-Kernel (apply_liger_kernel_to_llama), alone and under patch_hf")
            print("done: Liger", file=sys.stderr, flush=True)
    rep.table("The norm + residual-add section of one layer (HF's eager code on the layer's own modules against the "
              "ops the patched layer calls): decode = wall time per call of back-to-back calls at one token, "
              "prefill = kernel time at the prefill rows.",
              ["model", "section", "decode HF us", "patched us", "prefill HF us", "patched us"],
              [[r["name"], what, C.fmt(d_hf), C.fmt(d_tf), C.fmt(p_hf), C.fmt(p_tf)]
               for r in rows for what, d_hf, d_tf, p_hf, p_tf in r["section"]])
    if liger is not None:
        r = liger
        rep.table("With Liger-Kernel: the Llama patched by apply_liger_kernel_to_llama (RoPE, SwiGLU, RMSNorm, fused "
                  "linear + cross-entropy) against the same model with patch_hf on top (torchfuse's fused add + "
                  "RMSNorm in place of Liger's RMSNorm); training step = forward with the loss + backward, "
                  f"wall time, the mean of {r['steps']} steps; medians of interleaved rounds.",
                  ["model", "tokens", "prefill tok/s Liger", "Liger + torchfuse", "speedup", "training step ms Liger",
                   "Liger + torchfuse", "speedup", "first-step loss Liger", "Liger + torchfuse"],
                  [[r["name"], f"{r['batch']}x{r['length']}", f"{r['pre'][False]:,.0f}", f"{r['pre'][True]:,.0f}",
                    f"{r['pre'][True] / r['pre'][False]:.3f}x", f"{r['train'][False]:.2f}",
                    f"{r['train'][True]:.2f}", f"{r['train'][False] / r['train'][True]:.3f}x",
                    f"{r['loss'][False]:.5f}", f"{r['loss'][True]:.5f}"]])
    return rep


def add_args(ap):
    ap.add_argument("--tiny", action="store_true", help="tiny models (a CPU smoke run of the script)")
    ap.add_argument("--only", default=None, help="substring of one model name")


def main():
    import argparse
    if "--tiny" in sys.argv:  # the CPU smoke run: no GPU needed
        ap = argparse.ArgumentParser()
        ap.add_argument("--quick", action="store_true")
        ap.add_argument("--peers")
        ap.add_argument("--out")
        add_args(ap)
        print(run(ap.parse_args()).markdown(C.command_line()))
        return 0
    return C.standalone("hf", run, add_args, __doc__)


if __name__ == "__main__":
    sys.exit(main())
