"""Cached inference of one row per sequence, the case the CUDA split-key decode kernels take: each
(sequence, head) pair's last block to finish sums the chunks' partial rows, found by a per-pair counter
the kernel resets. These tests repeat calls, change shapes between calls, replay CUDA graphs and run
two streams at once, so that a counter left non-zero, shared by overlapping launches or counting a
block that writes nothing shows as a wrong or changed row; and they mix empty, one-row and long
sequences against a float64 reference of the newest row (on the CPU they check the CPU path)."""
import pytest
import torch
import torch.nn.functional as F

import torchfuse
from test_hstu import DTYPES, check, gr_valid_mask

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode kernels run on CUDA")


def last_row_reference(q1, k, v, starts, lens, max_seq_len, alpha, dtype, contextual_seq_len=0, max_attn_len=0):
    """The newest row of each sequence (keys starts[b] .. starts[b] + lens[b]) in `dtype`: (B, H, Dv),
    zero for empty sequences. q1 is (B, H, Dqk)."""
    B, H = q1.shape[0], q1.shape[1]
    out = torch.zeros(B, H, v.shape[2], dtype=dtype, device=q1.device)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        s = int(starts[b])
        kb, vb = k[s:s + n].to(dtype).transpose(0, 1), v[s:s + n].to(dtype).transpose(0, 1)  # (H, n, d)
        mask = gr_valid_mask(n, 0, contextual_seq_len, max_attn_len, 0, 1, False)[-1].to(q1.device)
        qk = (q1[b].to(dtype).unsqueeze(1) @ kb.transpose(1, 2)).squeeze(1)  # (H, n)
        p = F.silu(alpha * qk) / max_seq_len * mask
        out[b] = (p.unsqueeze(1) @ vb).squeeze(1)
    return out


def poison_allocator(device, shape, dtype):
    """Leaves NaN in the caching allocator's next block of this size, so that an output row the kernels
    fail to write (an empty sequence's) shows as NaN instead of a lucky zero."""
    if device == "cuda":
        torch.full(shape, float("nan"), device=device, dtype=dtype)


def jagged(lens, H, dqk, dv, device, dtype, slack=None, gen=None):
    slack = slack or [0] * len(lens)
    spans = [n + e for n, e in zip(lens, slack)]
    starts = torch.tensor([0] + torch.tensor(spans).cumsum(0).tolist(), dtype=torch.int64)
    L = int(starts[-1])
    k = torch.randn(L, H, dqk, generator=gen).to(device, dtype)
    v = torch.randn(L, H, dv, generator=gen).to(device, dtype)
    q1 = torch.randn(len(lens), H, dqk, generator=gen).to(device, dtype)
    return q1, k, v, starts.to(device)


@pytest.mark.parametrize("dqk, dv", [(256, 256), (64, 40), (25, 7)], ids=lambda d: str(d))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_decode_mixed_lengths_repeated(device, dtype, dqk, dv):
    """Empty and one-key sequences beside histories of many chunks (a chunk-0 block that zeroes the
    row, single blocks that are their pair's last, pairs of up to ~60 blocks), four heads, head dims
    read in 4-float and 1-float units by the last block: the same bits on every call, empty rows
    exactly zero, against float64."""
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    long1 = 3000 + int(torch.randint(0, 1000, (), generator=g))
    long2 = 500 + int(torch.randint(0, 500, (), generator=g))
    lens = [0, 1, long1, 0, 1, 2, long2, 63, 64, 65, 1, 0]
    H, alpha, kw = 4, 0.3, dict(contextual_seq_len=1, max_attn_len=2500)
    msl = long1 + int(torch.randint(0, 200, (), generator=g))
    q1, k, v, offsets = jagged(lens, H, dqk, dv, device, dtype, gen=g)
    outs = []
    for _ in range(3):
        poison_allocator(device, (len(lens), H, dv), dtype)
        outs.append(torchfuse.hstu_attention_cached(q1, k, v, offsets, msl, alpha, **kw))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    got = outs[0]
    want = last_row_reference(q1, k, v, offsets, lens, msl, alpha, torch.float64, **kw)
    want_lp = last_row_reference(q1, k, v, offsets, lens, msl, alpha, dtype, **kw)
    check("decode", got, want, want_lp, 2.0, dtype)
    empty = torch.tensor([n == 0 for n in lens], device=device)
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d).split(".")[-1])
def test_decode_padded_grid_plane_repeated(device, dtype):
    """More (sequence, head) pairs than one grid dimension holds (the kernels add a second plane, part of
    it past the last pair): its blocks must neither count nor write. Repeated calls give the same
    bits, empty sequences zero rows, and the last pairs (in the second plane) their float64 rows."""
    B, H, dqk, dv, alpha = 33001, 2, 64, 64, 0.5
    lens = torch.randint(0, 4, (B,))
    lens[-3:] = torch.tensor([0, 1, 3])
    q1, k, v, offsets = jagged(lens.tolist(), H, dqk, dv, device, dtype)
    outs = []
    for _ in range(2):
        poison_allocator(device, (B, H, dv), dtype)
        outs.append(torchfuse.hstu_attention_cached(q1, k, v, offsets, 3, alpha))
    assert torch.equal(outs[1], outs[0])
    got = outs[0].cpu()
    assert torch.equal(got[lens == 0], torch.zeros_like(got[lens == 0]))
    tail = slice(B - 40, B)
    lens_t = lens[tail].tolist()
    s0 = int(offsets[B - 40])
    sub = (q1[tail].cpu(), k[s0:].cpu(), v[s0:].cpu(), (offsets[B - 40:-1] - s0).cpu(), lens_t, 3, alpha)
    want = last_row_reference(*sub, torch.float64)
    want_lp = last_row_reference(*sub, dtype)
    check("decode tail", got[tail], want, want_lp, 2.0, dtype)


@cuda_only
def test_decode_counters_survive_shape_changes():
    """Calls of different pair counts and chunk counts one after another on one stream share its
    counters: each must leave them zero for the next, so a layout called again gives its first bits."""
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    layouts = [([4096], 4, 256), ([0, 1, 2000, 700, 1], 4, 128), ([300] * 200, 2, 64), ([1, 4000], 1, 32)]
    cases = []
    for lens, H, d in layouts:
        q1, k, v, offsets = jagged(lens, H, d, d, "cuda", dt, gen=g)
        cases.append((q1, k, v, offsets, max(lens)))
    first = [torchfuse.hstu_attention_cached(*c[:4], c[4], 0.2) for c in cases]
    for _ in range(2):
        for c, want in zip(reversed(cases), reversed(first)):
            assert torch.equal(torchfuse.hstu_attention_cached(*c[:4], c[4], 0.2), want)


@cuda_only
def test_decode_two_streams_at_once():
    """Launches on two streams may overlap: each stream has its own counters, so both give the bits of
    the same calls made one at a time."""
    dt = torch.bfloat16
    a = jagged([4096, 3000], 4, 256, 256, "cuda", dt)
    b = jagged([3500, 0, 4000, 1], 4, 256, 256, "cuda", dt)
    want_a = torchfuse.hstu_attention_cached(*a, 4096, 0.2)
    want_b = torchfuse.hstu_attention_cached(*b, 4096, 0.2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for s in (s1, s2):
        s.wait_stream(torch.cuda.current_stream())
    got_a, got_b = [], []
    for _ in range(20):
        with torch.cuda.stream(s1):
            got_a.append(torchfuse.hstu_attention_cached(*a, 4096, 0.2))
        with torch.cuda.stream(s2):
            got_b.append(torchfuse.hstu_attention_cached(*b, 4096, 0.2))
    for s in (s1, s2):
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for x in got_a:
        assert torch.equal(x, want_a)
    for x in got_b:
        assert torch.equal(x, want_b)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d).split(".")[-1])
def test_decode_graph_replays_match_eager(dtype):
    """A CUDA graph of decode calls over a cache with room after each sequence: each replay, with new
    queries and new kv_lengths (empty, one key, a full slot; so the pairs' chunk counts change between
    replays), gives the bits of the same eager calls. Two calls in the graph, the second with more
    pairs than the first's counters hold, and an eager call between replays on the capture stream."""
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    H, d, msl = 4, 128, 3000
    slots = [msl, 1500, 64, 200]
    q1, k, v, starts = jagged([0] * len(slots), H, d, d, "cuda", dtype, slack=slots, gen=g)
    kv = torch.zeros(len(slots), dtype=torch.int32, device="cuda")
    many = 400  # x 4 heads: past the first call's counters
    q2, k2, v2, offs2 = jagged([3] * many, H, d, d, "cuda", dtype, gen=g)

    def calls():
        a = torchfuse.hstu_attention_cached(q1, k, v, starts, msl, 0.3, validate=False, kv_lengths=kv)
        b = torchfuse.hstu_attention_cached(q2, k2, v2, offs2, 3, 0.3, validate=False)
        return a, b

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        calls()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        out_a, out_b = calls()
    for r in range(6):
        lens = [int(torch.randint(0, n + 1, (), generator=g)) for n in slots]
        lens[r % len(slots)] = [0, 1, slots[r % len(slots)]][r % 3]
        kv.copy_(torch.tensor(lens, dtype=torch.int32))
        q1.copy_(torch.randn(q1.shape, generator=g).to(dtype))
        q2.copy_(torch.randn(q2.shape, generator=g).to(dtype))
        graph.replay()
        want_a, want_b = calls()
        assert torch.equal(out_a, want_a), (r, lens)
        assert torch.equal(out_b, want_b), r
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # the capture stream, eager: its own counters
            again = calls()
        torch.cuda.synchronize()
        assert torch.equal(again[0], want_a) and torch.equal(again[1], want_b), r
    ref = last_row_reference(q1, k, v, starts, lens, msl, 0.3, torch.float64)
    ref_lp = last_row_reference(q1, k, v, starts, lens, msl, 0.3, dtype)
    check("decode graph", out_a, ref, ref_lp, 2.0, dtype)


@cuda_only
def test_decode_is_one_kernel_and_no_memset():
    """A call runs the one decode kernel (the chunks' sum in its last blocks, no second kernel), and once
    the stream's counters exist, no memset: the kernel leaves them zero."""
    q1, k, v, offsets = jagged([4096, 0, 1], 4, 256, 256, "cuda", torch.bfloat16)
    torchfuse.hstu_attention_cached(q1, k, v, offsets, 4096, 0.2, validate=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torchfuse.hstu_attention_cached(q1, k, v, offsets, 4096, 0.2, validate=False)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert [n for n in names if "hstu" in n or "emset" in n] == [n for n in names if "hstu_decode_partial" in n], names
    assert len([n for n in names if "hstu_decode_partial" in n]) == 1, names
