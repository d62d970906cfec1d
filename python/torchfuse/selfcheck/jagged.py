"""Jagged tensor ops against torchfuse.reference: data movement must be bit-exact (forward and
backward), jagged_dense_add within the add's own rounding."""
import torch

import torchfuse
from torchfuse import reference

from ._common import bench_row, close, exact

FAMILY = "jagged"


def _lengths(B, max_len, device):
    """B lengths with 0 and max_len among them, the rest random."""
    lens = torch.randint(0, max_len + 1, (B,))
    lens[0], lens[B // 2] = 0, max_len
    return lens.to(device)


def _offsets(lens, dtype):
    return torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(dtype)


def checks(ctx):
    dev, dt = ctx.device, ctx.dtype
    B, N, D = 9, 40, 24
    lens = _lengths(B, N + 7, dev)  # some samples longer than the dense length: truncated / kept
    out = []
    for odt in (torch.int32, torch.int64):
        off = _offsets(lens, odt)
        T = int(off[-1])
        tag = f" ({str(odt).replace('torch.', '')} offsets)"
        values = torch.randn(T, D, device=dev, dtype=dt, requires_grad=True)
        dense = torch.randn(B, N, D, device=dev, dtype=dt, requires_grad=True)

        got = torchfuse.jagged_to_padded_dense(values, off, N, -1.0)
        ref = reference.jagged_to_padded_dense(values, off, N, -1.0)
        out.append(exact("jagged_to_padded_dense" + tag, got, ref))
        g = torch.randn_like(got)
        out.append(exact("jagged_to_padded_dense backward" + tag, torch.autograd.grad(got, values, g)[0],
                         torch.autograd.grad(ref, values, g)[0]))

        got = torchfuse.dense_to_jagged(dense, off)
        ref = reference.dense_to_jagged(dense, off)
        out.append(exact("dense_to_jagged" + tag, got, ref))
        g = torch.randn_like(got)
        out.append(exact("dense_to_jagged backward" + tag, torch.autograd.grad(got, dense, g)[0],
                         torch.autograd.grad(ref, dense, g)[0]))

        got = torchfuse.jagged_dense_add(values, off, dense)
        ref64 = reference.jagged_dense_add(values.double(), off, dense.double())
        out.append(close("jagged_dense_add" + tag, got, ref64, reference.jagged_dense_add(values, off, dense)))
        g = torch.randn_like(got)
        gv, gd = torch.autograd.grad(got, (values, dense), g)
        rv, rd = torch.autograd.grad(reference.jagged_dense_add(values, off, dense), (values, dense), g)
        out.append(exact("jagged_dense_add backward" + tag, torch.cat([gv.flatten(), gd.flatten()]),
                         torch.cat([rv.flatten(), rd.flatten()]), shape=gv.shape))

    lens_r = _lengths(B, 13, dev)
    off_l, off_r = _offsets(lens, torch.int64), _offsets(lens_r, torch.int64)
    left = torch.randn(int(off_l[-1]), D, device=dev, dtype=dt)
    right = torch.randn(int(off_r[-1]), D, device=dev, dtype=dt)
    got, got_off = torchfuse.concat_2d_jagged(left, off_l, right, off_r)
    ref, ref_off = reference.concat_2d_jagged(left, off_l, right, off_r)
    out.append(exact("concat_2d_jagged", got, ref))
    out.append(exact("concat_2d_jagged offsets", got_off, ref_off))
    back_l, back_r = torchfuse.split_2d_jagged(got, off_l, off_r)
    out.append(exact("split_2d_jagged (inverse of concat)", torch.cat([back_l, back_r]), torch.cat([left, right])))

    lens_3 = _lengths(B, 5, dev)
    off_3 = _offsets(lens_3, torch.int64)
    third = torch.randn(int(off_3[-1]), D, device=dev, dtype=dt)
    parts, offs = [left, right, third], [off_l, off_r, off_3]
    got, got_off = torchfuse.jagged_concat(parts, offs)
    ref, ref_off = reference.jagged_concat(parts, offs)
    out.append(exact("jagged_concat (3-way)", got, ref))
    out.append(exact("jagged_concat offsets", got_off, ref_off))
    back = torchfuse.jagged_split(got, offs, [p.shape[0] for p in parts])
    out.append(exact("jagged_split (inverse of jagged_concat)", torch.cat(back), torch.cat(parts)))

    idx = torch.randint(0, B, (B + 3,), device=dev)  # repeats and omissions
    got, got_len = torchfuse.jagged_index_select(left, lens, idx)
    ref, ref_len = reference.jagged_index_select(left, lens, idx)
    out.append(exact("jagged_index_select", got, ref))
    out.append(exact("jagged_index_select lengths", got_len, ref_len))
    return out


def _eager_to_padded(values, offsets, B, N, T):
    """jagged -> padded in vectorised PyTorch: each row's place in the dense tensor (rows past N go
    to a scratch row), then one scatter; output_size keeps it free of host syncs."""
    lens = offsets[1:] - offsets[:-1]
    pos = torch.arange(T, device=values.device) - torch.repeat_interleave(offsets[:-1], lens, output_size=T)
    row = torch.repeat_interleave(torch.arange(B, device=values.device), lens, output_size=T) * N + pos
    row = torch.where(pos < N, row, B * N)
    out = values.new_zeros(B * N + 1, values.shape[-1])
    out[row] = values
    return out[:B * N].view(B, N, -1)


def _peer():
    try:
        import fbgemm_gpu  # noqa: F401
        return torch.ops.fbgemm.jagged_to_padded_dense
    except Exception:
        return None


def bench(ctx):
    dev = ctx.device
    B, N, D = (1024, 256, 256) if dev == "cuda" else (64, 128, 128)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(N // 2, N + 1, (B,), generator=g).to(dev)
    off = _offsets(lens, torch.int64)
    T = int(off[-1])
    values = torch.randn(T, D, device=dev, dtype=dt)
    fb = _peer()
    peer = (lambda: fb(values, [off], [N], 0.0)) if fb is not None else None
    nbytes = (T + B * N) * D * values.element_size()  # read the rows, write the padded tensor
    return bench_row(ctx, FAMILY, "jagged_to_padded_dense", (B, N, D), dt,
                     lambda: torchfuse.jagged_to_padded_dense(values, off, N),
                     lambda: _eager_to_padded(values, off, B, N, T), peer, "FBGEMM", nbytes=nbytes)
